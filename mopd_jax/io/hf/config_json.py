"""config.json of a Hugging Face model directory <-> ModelConfig, and the ModelConfig a run
config's `model` / `teacher` block describes (a preset, or a checkpoint's config.json plus
non-shape overrides)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional, Tuple

import jax.numpy as jnp

from mopd_jax import models
from mopd_jax.config import schema
from mopd_jax.models import ModelConfig

# architecture (config.json "architectures") -> family (ModelConfig.family) and back.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
FAMILY_ARCHITECTURE = {family: arch for arch, family in ARCHITECTURES.items()}
# model_type (config.json) of each family; the same strings as the families.
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# transformers' class defaults for keys a config.json may leave out.
_DEFAULT_MAX_POS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _dtype_name(dtype) -> str:
  name = jnp.dtype(dtype).name
  if name not in _DTYPE_NAMES:
    raise ValueError(f"dtype {name!r} is not supported; expected one of {_DTYPE_NAMES}")
  return name


def _family(hf: dict) -> str:
  archs = list(hf.get("architectures") or [])
  for arch in archs:
    if arch in ARCHITECTURES:
      return ARCHITECTURES[arch]
  if not archs and hf.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[hf["model_type"]]
  raise ValueError(
      f"unsupported architecture {archs or None} (model_type={hf.get('model_type')!r}); "
      f"supported: {sorted(ARCHITECTURES)}")


def _rope(hf: dict, family: str) -> Tuple[float, Optional[tuple]]:
  """(rope_theta, rope_scaling as a hashable tuple of pairs or None) from a v4 or v5 config."""
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  if not isinstance(params, dict):
    raise ValueError(f"rope_scaling / rope_parameters must be a dict, got {params!r}")
  if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
    raise ValueError(f"per-layer-type rope_parameters {sorted(params)} are not supported for "
                     f"{FAMILY_ARCHITECTURE[family]}")
  theta = _float_field({"rope_theta": params.get("rope_theta", hf.get("rope_theta"))},
                       "rope_theta", 10_000.0)
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    raise ValueError(f"partial_rotary_factor={partial} is not supported")
  kind = params.get("rope_type", params.get("type")) or "default"
  if kind == "default":
    return theta, None
  if kind == "linear":
    return theta, (("factor", float(params["factor"])), ("rope_type", "linear"))
  if kind == "llama3":
    orig = params.get("original_max_position_embeddings",
                      hf.get("original_max_position_embeddings",
                             hf.get("max_position_embeddings")))
    try:
      return theta, (("factor", float(params["factor"])),
                     ("high_freq_factor", float(params["high_freq_factor"])),
                     ("low_freq_factor", float(params["low_freq_factor"])),
                     ("original_max_position_embeddings", int(orig)),
                     ("rope_type", "llama3"))
    except (KeyError, TypeError) as e:
      raise ValueError(f"llama3 rope scaling is missing {e}: {params}") from None
  raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


def config_from_hf(hf: dict, dtype=None) -> ModelConfig:
  """The ModelConfig of a Hugging Face `config.json` dict.

  `dtype` (None: the checkpoint's `torch_dtype` / `dtype`, float32 if it names none we know)
  becomes both the param and the compute dtype.
  """
  family = _family(hf)
  arch = FAMILY_ARCHITECTURE[family]
  act = hf.get("hidden_act", "silu")
  if act not in ("silu", "swish"):
    raise ValueError(f"{arch}: hidden_act={act!r} is not supported (SwiGLU with silu only)")
  if hf.get("mlp_bias"):
    raise ValueError(f"{arch}: mlp_bias=True is not supported")
  if family in ("llama", "qwen3") and hf.get("attention_bias"):
    raise ValueError(f"{arch}: attention_bias=True (which also biases o_proj) is not supported; "
                     "only Qwen2's q/k/v biases are")
  if hf.get("use_sliding_window"):
    raise ValueError(f"{arch}: use_sliding_window=True is not supported")
  theta, scaling = _rope(hf, family)
  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")
  absent = [k for k in required if hf.get(k) is None]
  if absent:
    raise ValueError(f"{arch} config.json lacks {absent}")
  sizes = {k: _int_field(hf, k) for k in required}
  d, h = sizes["hidden_size"], sizes["num_attention_heads"]
  kv = _int_field(hf, "num_key_value_heads", h)
  head_dim = _int_field(hf, "head_dim", d // h if d % h == 0 else 0)
  if head_dim == 0:
    raise ValueError(f"hidden_size={d} is not a multiple of num_attention_heads={h} and no "
                     "head_dim is given")
  if dtype is None:
    stored = hf.get("torch_dtype", hf.get("dtype"))
    dtype = stored if stored in _DTYPE_NAMES else "float32"
  dtype = _dtype_name(dtype)
  return ModelConfig(
      vocab_size=sizes["vocab_size"], d_model=d, num_layers=sizes["num_hidden_layers"],
      num_heads=h, num_kv_heads=kv, head_dim=head_dim, mlp_dim=sizes["intermediate_size"],
      rope_theta=theta, rope_scaling=scaling, qk_norm=family == "qwen3",
      attention_bias=family == "qwen2", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      norm_eps=_float_field(hf, "rms_norm_eps", 1e-6),  # transformers' default for all three
      max_seq_len=_int_field(hf, "max_position_embeddings", _DEFAULT_MAX_POS[family]),
      param_dtype=dtype, dtype=dtype, family=family)


def config_to_hf(cfg: ModelConfig) -> dict:
  """The Hugging Face `config.json` dict of a ModelConfig (v4 and v5 rope spellings both)."""
  if cfg.family not in FAMILY_ARCHITECTURE:
    raise ValueError(f"ModelConfig.family={cfg.family!r} has no Hugging Face architecture; "
                     f"supported: {sorted(FAMILY_ARCHITECTURE)}")
  arch = FAMILY_ARCHITECTURE[cfg.family]
  if cfg.qk_norm != (cfg.family == "qwen3"):
    raise ValueError(f"{arch} {'requires' if cfg.family == 'qwen3' else 'has no'} QK-norm but "
                     f"the config has qk_norm={cfg.qk_norm}")
  if cfg.attention_bias and cfg.family != "qwen2":
    raise ValueError(f"{arch} has no q/k/v-only attention bias; use family='qwen2'")
  scaling = dict(cfg.rope_scaling) if cfg.rope_scaling is not None else None
  if scaling is not None:
    kind = scaling.get("rope_type", scaling.get("type"))
    scaling = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": kind}
  rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
  hf = {
      "architectures": [arch],
      "model_type": _MODEL_TYPES[cfg.family],
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      "rope_scaling": scaling,
      "rope_parameters": rope_parameters,
      "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": cfg.param_dtype,
      "dtype": cfg.param_dtype,
      "initializer_range": 0.02,
      "use_cache": True,
      "attention_dropout": 0.0,
  }
  if cfg.family == "llama":
    hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  else:
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    if cfg.family == "qwen3":
      hf["attention_bias"] = False
  return hf


def _read_json(path: str) -> dict:
  """A JSON object from `path`; ValueError naming the file for anything else."""
  try:
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise ValueError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
  except ValueError as e:  # e.g. an integer over Python's digit limit
    raise ValueError(f"{path}: unreadable JSON value ({e})") from None
  if not isinstance(out, dict):
    raise ValueError(f"{path}: expected a JSON object, got a {type(out).__name__}")
  return out


def _int_field(hf: dict, key: str, default=None, *, lo: int = 1) -> int:
  """`hf[key]` (or `default` when absent or null) as an int >= lo; ValueError naming it."""
  v = hf.get(key)
  if v is None:
    if default is None:
      raise ValueError(f"{key} is missing")
    return default
  if isinstance(v, bool) or not isinstance(v, int) or v < lo:
    raise ValueError(f"{key}={v!r} must be an int >= {lo}")
  return v


def _float_field(hf: dict, key: str, default: float) -> float:
  v = hf.get(key)
  if v is None:
    return default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
    raise ValueError(f"{key}={v!r} must be a finite number > 0")
  return float(v)


def load_config(path: str, dtype=None) -> ModelConfig:
  """The ModelConfig of a Hugging Face model directory (reads only `config.json`).

  Errors: ValueError naming `config.json` and the field: no such file, not JSON or not a
  JSON object, an unsupported architecture or option, a size that is not a positive int,
  a non-finite or non-positive rope_theta / rms_norm_eps, heads that do not divide."""
  cfg_file = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_file):
    raise ValueError(f"{path}: no config.json (expected a Hugging Face model directory)")
  try:
    return config_from_hf(_read_json(cfg_file), dtype)
  except ValueError as e:
    msg = str(e)
    raise ValueError(msg if msg.startswith(cfg_file) else f"{cfg_file}: {msg}") from None


def _block_keys() -> tuple:
  """The fields of the config's `model` and `teacher` blocks (mopd_jax/config/schema.py's
  ModelSpec and TeacherSpec) that are not ModelConfig fields: "preset" first, then sorted."""
  model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
  fields = {f.name for spec in (schema.ModelSpec, schema.TeacherSpec)
            for f in dataclasses.fields(spec)}
  return ("preset", *sorted(fields - model_fields - {"model", "overrides", "preset"}))


# Keys of a `model` / `teacher` config block that are not ModelConfig fields.
BLOCK_KEYS = _block_keys()
# Overrides that would change the shape of a checkpoint's tensors.
_SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "mlp_dim", "qk_norm", "attention_bias", "tie_embeddings", "family")


def resolve_model_config(block, vocab_size: int, hf_path: str = "") -> ModelConfig:
  """The ModelConfig a `model` (or `teacher`) block of a run config describes.

  `block`: a mapping with `preset` and ModelConfig field overrides (plus the non-field keys
  `hf_path`, `hf_paths`, `tokenizer_path`, ignored here). `hf_path` (default: the block's own
  `hf_path`, if any): a Hugging Face checkpoint whose config.json wins over the preset; the
  block's overrides may then only restate its shape (ValueError otherwise) or change non-shape
  fields (quant, dtype, max_seq_len, ...). A tokenizer with more tokens than the checkpoint's
  embedding has rows (added specials, e.g. effort tokens, on a checkpoint with no spare rows
  such as Llama 3) gives a ModelConfig with the tokenizer's `vocab_size`:
  `load_checkpoint(..., vocab_size=)` grows the embedding (and an untied head) to it, and an
  export records the grown vocabulary. A larger (padded) embedding is kept as it is.
  """
  block = dict(block)
  overrides = {k: v for k, v in block.items() if k not in BLOCK_KEYS}
  hf_path = hf_path or block.get("hf_path") or ""
  if not hf_path:
    return models.get_preset(block["preset"], vocab_size=vocab_size, **overrides)
  cfg = load_config(hf_path, overrides.get("param_dtype"))
  if vocab_size > cfg.vocab_size:
    cfg = cfg.replace(vocab_size=vocab_size)  # grown on load (load_checkpoint)
  for k in _SHAPE_FIELDS:
    if k in overrides and overrides[k] != getattr(cfg, k):
      raise ValueError(f"override {k}={overrides[k]!r} contradicts the checkpoint {hf_path} "
                       f"({k}={getattr(cfg, k)!r})")
  return cfg.replace(**{k: v for k, v in overrides.items() if k not in _SHAPE_FIELDS})
