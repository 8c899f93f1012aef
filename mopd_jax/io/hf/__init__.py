"""Hugging Face checkpoints <-> (ModelConfig, params), safetensors only.

    cfg, params = hf.load_checkpoint("/ckpt/Qwen3-1.7B")      # on the default device
    cfg = hf.load_config("/ckpt/Qwen3-1.7B")
    cfg, params = hf.load_checkpoint(path, sharding=mesh)      # or a pytree of shardings
    hf.save_checkpoint(cfg, params, "/out/student")            # reloads in transformers

Supported: `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` (GQA, RoPE theta and the
`linear` / `llama3` scalings, tied or untied embeddings, Qwen2's q/k/v biases, Qwen3's QK-norm).
Both the transformers v4 `config.json` (top-level `rope_theta` / `rope_scaling`) and the v5 one
(`rope_parameters`) are read; `save_checkpoint` writes both spellings, so v4 and v5 readers
agree.

Layouts. A torch `nn.Linear` stores its weight [out, in]; this project stores [in, out] with the
head axes split out: q/k/v [D, heads, hd], o [heads, hd, D], MLP [in, out], lm_head [D, V].
Every tensor is converted by one function (`_read_block`) that maps a block of *our* array (a
tuple of slices) to the slice of the safetensors tensor that holds it, so a sharded load reads
exactly the rows and columns each device needs (`safe_open(...).get_slice`) through
`jax.make_array_from_callback`, and no host ever holds a full sharded tensor. An unsharded load
uses the same function with the whole-array block.

No pickle anywhere: a directory with only `*.bin` / `*.pt` weights is refused with a clear error.

Modules: `config_json` (config.json <-> ModelConfig, and run-config model blocks), `layout`
(tensor names, shapes and the block reader), `files` (the safetensors files of a directory),
`load` (onto the default device or a mesh) and `export`.
"""
from mopd_jax.io.hf.config_json import (ARCHITECTURES, BLOCK_KEYS, FAMILY_ARCHITECTURE,
                                     config_from_hf, config_to_hf, load_config,
                                     resolve_model_config)
from mopd_jax.io.hf.export import DEFAULT_MAX_SHARD_BYTES, save_checkpoint
from mopd_jax.io.hf.load import load_checkpoint

__all__ = ["ARCHITECTURES", "BLOCK_KEYS", "DEFAULT_MAX_SHARD_BYTES", "FAMILY_ARCHITECTURE",
           "config_from_hf", "config_to_hf", "load_checkpoint", "load_config",
           "resolve_model_config", "save_checkpoint"]
