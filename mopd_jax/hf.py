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
"""
from __future__ import annotations

import glob
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors' numpy reader)
import numpy as np
from jax.sharding import Mesh, Sharding
from safetensors import safe_open
from safetensors.numpy import save_file

from mopd_jax import models
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
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024 ** 3  # transformers' default max_shard_size ("5GB")

# ----------------------------------------------------------------------------- config.json


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


def _int_field(hf: dict, key: str, default=None, lo: int = 1) -> int:
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


# Keys of a `model` / `teacher` config block that are not ModelConfig fields.
BLOCK_KEYS = ("preset", "hf_path", "hf_paths", "tokenizer_path", "outside_cell", "outside_seed",
              "effort_in_prompt")
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


# ----------------------------------------------------------------------------- tensor layouts
# kind of each param: how our array relates to the torch tensor.
#   copy     ours == theirs (embedding, norm scales)
#   t        ours [in, out] == theirs[out, in].T (MLP, lm_head)
#   in_heads ours [D, N, hd] == theirs[N*hd, D].T reshaped (q/k/v)
#   out_heads ours [H, hd, D] == theirs[D, H*hd].T reshaped (o)
#   bias     ours [N, hd] == theirs[N*hd] reshaped (q/k/v bias)


def _hf_shape(kind: str, shape: tuple) -> tuple:
  if kind == "copy":
    return tuple(shape)
  if kind == "t":
    return (shape[1], shape[0])
  if kind == "in_heads":
    return (shape[1] * shape[2], shape[0])
  if kind == "out_heads":
    return (shape[2], shape[0] * shape[1])
  if kind == "bias":
    return (shape[0] * shape[1],)
  raise AssertionError(kind)


def _param_specs(cfg: ModelConfig) -> List[Tuple[tuple, str, str, tuple]]:
  """(our param path, torch tensor name, kind, our shape) of every param, in HF order."""
  d, h, kv, hd, f, v = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                        cfg.vocab_size)
  specs = [(("embed",), "model.embed_tokens.weight", "copy", (v, d))]
  for i in range(cfg.num_layers):
    ours, hf = f"layers_{i}", f"model.layers.{i}"
    specs += [
        ((ours, "input_norm", "scale"), f"{hf}.input_layernorm.weight", "copy", (d,)),
        ((ours, "attn", "q_proj"), f"{hf}.self_attn.q_proj.weight", "in_heads", (d, h, hd)),
        ((ours, "attn", "k_proj"), f"{hf}.self_attn.k_proj.weight", "in_heads", (d, kv, hd)),
        ((ours, "attn", "v_proj"), f"{hf}.self_attn.v_proj.weight", "in_heads", (d, kv, hd)),
        ((ours, "attn", "o_proj"), f"{hf}.self_attn.o_proj.weight", "out_heads", (h, hd, d)),
    ]
    if cfg.attention_bias:
      specs += [((ours, "attn", "q_bias"), f"{hf}.self_attn.q_proj.bias", "bias", (h, hd)),
                ((ours, "attn", "k_bias"), f"{hf}.self_attn.k_proj.bias", "bias", (kv, hd)),
                ((ours, "attn", "v_bias"), f"{hf}.self_attn.v_proj.bias", "bias", (kv, hd))]
    if cfg.qk_norm:
      specs += [((ours, "attn", "q_norm", "scale"), f"{hf}.self_attn.q_norm.weight", "copy", (hd,)),
                ((ours, "attn", "k_norm", "scale"), f"{hf}.self_attn.k_norm.weight", "copy", (hd,))]
    specs += [
        ((ours, "post_attn_norm", "scale"), f"{hf}.post_attention_layernorm.weight", "copy", (d,)),
        ((ours, "mlp", "gate_proj"), f"{hf}.mlp.gate_proj.weight", "t", (d, f)),
        ((ours, "mlp", "up_proj"), f"{hf}.mlp.up_proj.weight", "t", (d, f)),
        ((ours, "mlp", "down_proj"), f"{hf}.mlp.down_proj.weight", "t", (f, d)),
    ]
  specs.append((("final_norm", "scale"), "model.norm.weight", "copy", (d,)))
  if not cfg.tie_embeddings:
    specs.append((("lm_head",), "lm_head.weight", "t", (d, v)))
  return specs


def _to_hf(kind: str, x: np.ndarray) -> np.ndarray:
  """A whole param in our layout -> the torch layout (contiguous)."""
  if kind == "copy":
    out = x
  elif kind == "t":
    out = x.T
  elif kind == "in_heads":
    out = x.reshape(x.shape[0], -1).T
  elif kind == "out_heads":
    out = x.reshape(-1, x.shape[2]).T
  elif kind == "bias":
    out = x.reshape(-1)
  else:
    raise AssertionError(kind)
  return np.ascontiguousarray(out)


def _bounds(index: tuple, shape: tuple) -> List[Tuple[int, int, int]]:
  """(start, stop, step) per dim of a block index (slices, possibly shorter than the rank)."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return [s.indices(n) for s, n in zip(index, shape)]


def _hull(b: Tuple[int, int, int]) -> Tuple[slice, slice]:
  """(contiguous slice covering the block, step slice to apply to it afterwards)."""
  start, stop, step = b
  if step == 1:
    return slice(start, stop), slice(None)
  last = start + ((stop - start - 1) // step) * step if stop > start else start - 1
  return slice(start, last + 1), slice(None, None, step)


def _read_slice(handle, name: str, slices: tuple) -> np.ndarray:
  """The one place tensor data is read: `slices` (contiguous) of tensor `name`."""
  return handle.get_slice(name)[slices]


def _read_block(handle, name: str, kind: str, shape: tuple, index: tuple) -> np.ndarray:
  """Block `index` (a tuple of slices into our array of `shape`) of param `name`, read from
  safetensors as the matching slice of the torch-layout tensor, in our layout."""
  b = _bounds(index, shape)
  hulls = [_hull(x) for x in b]
  outer = tuple(h[0] for h in hulls)
  steps = tuple(h[1] for h in hulls)
  if kind == "copy":
    return _read_slice(handle, name, outer)[steps]
  if kind == "t":
    return _read_slice(handle, name, (outer[1], outer[0])).T[steps]
  if kind == "bias":  # ours [N, hd] <- theirs [N*hd]
    n0, n1 = outer[0].start, outer[0].stop
    hd = shape[1]
    x = _read_slice(handle, name, (slice(n0 * hd, n1 * hd),)).reshape(n1 - n0, hd)
    return x[:, outer[1]][steps]
  if kind == "in_heads":  # ours [D, N, hd] <- theirs [N*hd, D]
    n0, n1 = outer[1].start, outer[1].stop
    hd = shape[2]
    x = _read_slice(handle, name, (slice(n0 * hd, n1 * hd), outer[0]))  # [n*hd, d]
    x = x.reshape(n1 - n0, hd, -1)[:, outer[2], :]  # [n, k, d]
    return np.transpose(x, (2, 0, 1))[steps]
  if kind == "out_heads":  # ours [H, hd, D] <- theirs [D, H*hd]
    n0, n1 = outer[0].start, outer[0].stop
    hd = shape[1]
    x = _read_slice(handle, name, (outer[2], slice(n0 * hd, n1 * hd)))  # [d, n*hd]
    x = x.reshape(-1, n1 - n0, hd)[:, :, outer[1]]  # [d, n, k]
    return np.transpose(x, (1, 2, 0))[steps]
  raise AssertionError(kind)


# ----------------------------------------------------------------------------- files


class _Tensors:
  """name -> (safetensors file, shape, dtype) over a model directory, files opened lazily."""

  def __init__(self, path: str):
    self.path = path
    self._handles: Dict[str, Any] = {}
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
      weight_map = _read_json(index_file).get("weight_map")
      if not isinstance(weight_map, dict) or not all(
          isinstance(f, str) and f and os.path.basename(f) == f for f in weight_map.values()):
        raise ValueError(f"{index_file}: weight_map must map tensor names to file names in "
                         "the same directory")
      self.files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
      for fname in sorted(set(self.files.values())):
        if not os.path.isfile(fname):
          raise ValueError(f"{index_file} names {os.path.basename(fname)}, which is missing")
    else:
      single = os.path.join(path, "model.safetensors")
      files = [single] if os.path.isfile(single) else sorted(
          glob.glob(os.path.join(path, "*.safetensors")))
      if not files:
        pickled = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*"))
                         if p.endswith(_PICKLE_SUFFIXES))
        if pickled:
          raise ValueError(
              f"{path}: only pickle-based weights {pickled}; loading them could run arbitrary "
              "code, so only safetensors are supported. Convert them first, e.g. "
              "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, "
              "safe_serialization=True)` in a trusted environment.")
        raise ValueError(f"{path}: no *.safetensors weights found")
      self.files = {}
      for fname in files:
        for name in self.handle(fname).keys():
          self.files[name] = fname

  def handle(self, fname: str):
    if fname not in self._handles:
      try:
        self._handles[fname] = safe_open(fname, framework="numpy")
      except Exception as e:  # safetensors' own error type: a truncated or corrupt file
        raise ValueError(f"{fname}: not a readable safetensors file ({e})") from None
    return self._handles[fname]

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def names(self):
    return self.files.keys()

  def handle_for(self, name: str):
    return self.handle(self.files[name])

  def shape(self, name: str) -> tuple:
    return tuple(self.handle_for(name).get_slice(name).get_shape())

  def dtype(self, name: str) -> str:
    return self.handle_for(name).get_slice(name).get_dtype()


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def _resolve_shardings(cfg: ModelConfig, sharding):
  """None | Mesh | one Sharding for all | a pytree like params -> function path -> Sharding."""
  if sharding is None:
    return None
  if isinstance(sharding, Mesh):
    from mopd_jax import sharding as sharding_lib
    sharding = sharding_lib.param_shardings(cfg, sharding)
  if isinstance(sharding, Sharding):
    return lambda path: sharding

  def lookup(path):
    try:
      s = _get(sharding, path)
    except (KeyError, TypeError):
      raise ValueError(f"the sharding pytree has no entry for param {'/'.join(path)}") from None
    if not isinstance(s, Sharding):
      raise ValueError(f"sharding of param {'/'.join(path)} is {s!r}, not a jax Sharding")
    return s
  return lookup


def load_checkpoint(path: str, sharding=None, dtype=None,
                    vocab_size: Optional[int] = None) -> Tuple[ModelConfig, dict]:
  """(ModelConfig, params) of a Hugging Face model directory.

  `path`: a directory with `config.json` and `*.safetensors` (one file, several, or sharded
  with `model.safetensors.index.json`).
  `sharding`: None (whole arrays on the default device); a `Mesh` (placed with
  `mopd_jax.sharding.param_shardings(cfg, mesh)`); one `Sharding` for every param; or a pytree
  of shardings shaped like the params (e.g. from `param_shardings(load_config(path), mesh)`).
  With a sharding each device's shard is read on its own, as the slice of the safetensors
  tensor that holds it.
  `dtype`: param (and compute) dtype; None keeps the checkpoint's `torch_dtype`.
  `vocab_size`: a vocabulary larger than the checkpoint's (a tokenizer with added specials):
  the embedding, and an untied head, grow by the missing rows, each initialised to the mean
  of the stored rows, so a new token starts as the average token; the returned ModelConfig
  has this vocabulary. None or a smaller value keeps the checkpoint's.

  Errors: ValueError naming the file (and field or tensor) for everything `load_config`
  refuses, an unsupported architecture or feature, a missing tensor, a tensor of the wrong
  shape or dtype, unexpected extra tensors, an index that is not a JSON object or names files
  outside the directory, a truncated or corrupt safetensors file, and pickle-only checkpoints.
  """
  cfg = load_config(path, dtype)
  tensors = _Tensors(path)
  specs = _param_specs(cfg)
  arch = FAMILY_ARCHITECTURE[cfg.family]
  expected = {name for _, name, _, _ in specs}
  missing = [name for name in expected if name not in tensors]
  if missing:
    missing.sort(key=[n for _, n, _, _ in specs].index)
    raise ValueError(f"{path}: {arch} checkpoint is missing tensor(s) {missing[:8]}"
                     f"{' ...' if len(missing) > 8 else ''} ({len(missing)} missing)")
  allowed = set(expected)
  if cfg.tie_embeddings:
    allowed.add("lm_head.weight")  # some tied checkpoints store the head anyway; it is the embed
  extra = sorted(n for n in tensors.names()
                 if n not in allowed and not n.endswith(_IGNORED_SUFFIXES))
  if extra:
    raise ValueError(f"{path}: unexpected tensor(s) for {arch} {extra[:8]}"
                     f"{' ...' if len(extra) > 8 else ''}: an unsupported feature of the "
                     "architecture (e.g. o_proj or MLP biases)")
  for _, name, kind, shape in specs:
    want, got = _hf_shape(kind, shape), tensors.shape(name)
    if got != want:
      raise ValueError(f"{path}: tensor {name} has shape {list(got)}, expected {list(want)} "
                       "from config.json")
    if tensors.dtype(name) not in _ST_DTYPES:
      raise ValueError(f"{path}: tensor {name} has dtype {tensors.dtype(name)}; expected one "
                       f"of {sorted(_ST_DTYPES)}")

  np_dtype = jnp.dtype(cfg.param_dtype)
  grown = {}  # our path -> the whole grown array (host), for the vocabulary-sized params
  if vocab_size is not None and vocab_size > cfg.vocab_size:
    new_cfg = cfg.replace(vocab_size=int(vocab_size))
    new_shapes = {ours: shape for ours, _, _, shape in _param_specs(new_cfg)}
    for ours, name, kind, shape in specs:
      if new_shapes[ours] != shape:
        stored = np.asarray(_read_block(tensors.handle_for(name), name, kind, shape, ()),
                            np.float32)
        axis = 0 if ours == ("embed",) else 1  # embed [V, D]; lm_head [D, V]
        extra = new_shapes[ours][axis] - shape[axis]
        mean = stored.mean(axis=axis, keepdims=True)
        grown[ours] = np.concatenate([stored, np.repeat(mean, extra, axis=axis)],
                                     axis=axis).astype(np_dtype)
    cfg = new_cfg
    specs = [(ours, name, kind, new_shapes[ours]) for ours, name, kind, _ in specs]
  shard_of = _resolve_shardings(cfg, sharding)
  params: dict = {}
  for ours, name, kind, shape in specs:
    handle = tensors.handle_for(name)
    if ours in grown:
      full = grown[ours]
      value = (jnp.asarray(full) if shard_of is None else jax.make_array_from_callback(
          shape, shard_of(ours), lambda index, full=full: full[index]))
    elif shard_of is None:
      block = _read_block(handle, name, kind, shape, ())
      value = jnp.asarray(np.asarray(block, np_dtype))
    else:
      blocks: Dict[tuple, np.ndarray] = {}  # a block replicated on several devices is read once

      def cb(index, handle=handle, name=name, kind=kind, shape=shape, blocks=blocks):
        key = tuple(_bounds(index, shape))
        if key not in blocks:
          blocks[key] = np.asarray(_read_block(handle, name, kind, shape, index), np_dtype)
        return blocks[key]
      value = jax.make_array_from_callback(shape, shard_of(ours), cb)
      blocks.clear()
    _set(params, ours, value)
  return cfg, params


# ----------------------------------------------------------------------------- save


def _to_host(x) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def save_checkpoint(model_config: ModelConfig, params, path: str, *,
                    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
                    extra_config: Optional[dict] = None) -> None:
  """Write a Hugging Face model directory: `config.json` and safetensors in torch layout.

  One `model.safetensors` when the tensors fit in `max_shard_size` bytes, otherwise
  `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. A QAT config
  (`quant != "none"`) exports the fake-quantised weights its forward pass sees. Tensors keep
  the params' dtype. `extra_config` is merged into config.json (e.g. bos/eos token ids).
  On several hosts every process must call this; process 0 writes.
  """
  cfg, params = models.materialize(model_config, params)
  hf_cfg = config_to_hf(cfg)
  if extra_config:
    hf_cfg.update(extra_config)
  specs = _param_specs(cfg)
  for ours, name, kind, shape in specs:
    try:
      leaf = _get(params, ours)
    except (KeyError, TypeError):
      raise ValueError(f"params have no {'/'.join(ours)} (for {name})") from None
    if tuple(leaf.shape) != tuple(shape):
      raise ValueError(f"param {'/'.join(ours)} has shape {tuple(leaf.shape)}, expected "
                       f"{tuple(shape)} from the model config")
  # Plan the files from shapes alone, then convert one file's tensors at a time.
  groups: List[List[tuple]] = [[]]
  size = 0
  for spec in specs:
    leaf = _get(params, spec[0])
    nbytes = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
    if groups[-1] and size + nbytes > max_shard_size:
      groups.append([])
      size = 0
    groups[-1].append(spec)
    size += nbytes
  write = jax.process_index() == 0
  if write:
    os.makedirs(path, exist_ok=True)
    # Weights of an earlier export here would be mixed into the next load: remove them.
    for pattern in ("model.safetensors", "model-*-of-*.safetensors",
                    "model.safetensors.index.json"):
      for stale in glob.glob(os.path.join(path, pattern)):
        os.remove(stale)
  n = len(groups)
  weight_map, total = {}, 0
  for k, group in enumerate(groups):
    fname = "model.safetensors" if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    arrays = {}
    for ours, name, kind, _ in group:
      arrays[name] = _to_hf(kind, _to_host(_get(params, ours)))
      total += arrays[name].nbytes
      weight_map[name] = fname
    if write:
      save_file(arrays, os.path.join(path, fname), metadata={"format": "pt"})
    del arrays
  if write:
    if n > 1:
      with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(hf_cfg, f, indent=2, sort_keys=True)
