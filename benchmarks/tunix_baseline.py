"""Decode throughput of Tunix's vanilla JAX sampler on the benchmark shape (the baseline of
`decode_tokens_per_s`). Prints one JSON object.

Runs under an interpreter that has `google-tunix` installed. Tunix pins older Hugging Face
packages than this project's test extra, so it lives in its own virtualenv and
`benchmarks.core --tunix-python VENV/bin/python` runs this file there, between two
measurements of our own sampler, so that both figures come from one benchmark run:

    python -m venv /tmp/tunix && /tmp/tunix/bin/pip install google-tunix==0.1.7
    python -m benchmarks.core --json --tunix-python /tmp/tunix/bin/python

The shape and the sampling match `benchmarks.core.decode_benchmark`: a Llama-style decoder
(vocab 32k, d_model 256, 4 layers, 4 query and 4 kv heads of 64, MLP 1024, tied embeddings,
float32, random init); 8 prompts of 64 random ids, 128 new tokens, temperature 1 with no
truncation. With top_p=1 and no top_k, Tunix draws each token by `jax.random.categorical`
over the full vocabulary (with top_p=None it would decode greedily instead). The EOS id is
-1, which no draw can produce, so every row decodes all 128 tokens (checked).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.llama3 import model as llama3_lib


class _IdTokenizer:
  """Tunix's sampler takes text: a prompt here is its token ids written out, space-separated."""

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0  # falsy: Tunix adds no BOS

  def eos_id(self):
    return -1

  def pad_id(self):
    return 0  # prompts draw ids from [1, vocab)


def build_model(vocab: int, seed: int = 0):
  cfg = llama3_lib.ModelConfig(
      num_layers=4, vocab_size=vocab, embed_dim=256, hidden_dim=1024, num_heads=4,
      head_dim=64, num_kv_heads=4, rope_theta=500_000, norm_eps=1e-5, weight_tying=True,
      shd_config=llama3_lib.ShardingConfig.get_default_sharding(is_sampling=True))
  model = llama3_lib.Llama3(cfg, rngs=nnx.Rngs(params=seed))
  # Tunix zero-initialises the MLP kernels; random ones make it a random-init network like
  # ours (the work per step is the same either way).
  key = jax.random.PRNGKey(seed + 1)
  for layer in model.layers:
    for lin in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
      key, sub = jax.random.split(key)
      lin.kernel.value = 0.02 * jax.random.normal(sub, lin.kernel.value.shape, jnp.float32)
  return model, cfg


def measure(batch: int = 8, prompt_len: int = 64, new_tokens: int = 128, vocab: int = 32_000,
            repeats: int = 5) -> dict:
  model, cfg = build_model(vocab)
  sampler = sampler_lib.Sampler(model, _IdTokenizer(), sampler_lib.CacheConfig(
      cache_size=prompt_len + new_tokens, num_layers=cfg.num_layers,
      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
  ids = np.random.default_rng(0).integers(1, vocab, (batch, prompt_len), dtype=np.int32)
  prompts = [" ".join(map(str, row)) for row in ids]

  def generate(seed):
    return sampler(prompts, max_generation_steps=new_tokens, max_prompt_length=prompt_len,
                   echo=False, eos_tokens=[-1], temperature=1.0, top_p=1.0, top_k=None,
                   seed=seed)

  out = generate(0)  # compiles
  lengths = [len(t) for t in out.tokens]
  if lengths != [new_tokens] * batch:
    raise RuntimeError(f"Tunix generated {lengths} tokens per row, expected {new_tokens}")
  times = []
  for r in range(repeats):
    t = time.perf_counter()
    generate(r + 1)  # returns host-side token lists: the call is complete when it returns
    times.append(time.perf_counter() - t)
  return {"tunix_version": importlib.metadata.version("google-tunix"),
          "tunix_jax_version": jax.__version__,
          "tunix_decode_tokens_per_s": batch * new_tokens / min(times)}


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--vocab", type=int, default=32_000)
  a = ap.parse_args()
  print(json.dumps(measure(a.batch, a.prompt_len, a.new_tokens, examples=a.vocab)))


if __name__ == "__main__":
  main()
