"""Loading a Hugging Face model directory as (ModelConfig, params): whole on the default device,
or sharded, each device's shard read on its own through `jax.make_array_from_callback`."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, Sharding

from mopd_jax.io.hf.config_json import FAMILY_ARCHITECTURE, load_config
from mopd_jax.io.hf.files import _Tensors
from mopd_jax.io.hf.layout import _bounds, _hf_shape, _param_specs, _read_block
from mopd_jax.models import ModelConfig

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
    from mopd_jax.runtime import sharding as sharding_lib
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
                    *, vocab_size: Optional[int] = None) -> Tuple[ModelConfig, dict]:
  """(ModelConfig, params) of a Hugging Face model directory.

  `path`: a directory with `config.json` and `*.safetensors` (one file, several, or sharded
  with `model.safetensors.index.json`).
  `sharding`: None (whole arrays on the default device); a `Mesh` (placed with
  `mopd_jax.runtime.sharding.param_shardings(cfg, mesh)`); one `Sharding` for every param; or a pytree
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
        stored = np.asarray(_read_block(tensors.handle_for(name), name, kind, shape=shape,
                                        index=()),
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
      block = _read_block(handle, name, kind, shape=shape, index=())
      value = jnp.asarray(np.asarray(block, np_dtype))
    else:
      blocks: Dict[tuple, np.ndarray] = {}  # a block replicated on several devices is read once

      def cb(index, handle=handle, name=name, *, kind=kind, shape=shape, blocks=blocks):
        key = tuple(_bounds(index, shape))
        if key not in blocks:
          blocks[key] = np.asarray(_read_block(handle, name, kind, shape=shape, index=index),
                                   np_dtype)
        return blocks[key]
      value = jax.make_array_from_callback(shape, shard_of(ours), cb)
      blocks.clear()
    _set(params, ours, value)
  return cfg, params
