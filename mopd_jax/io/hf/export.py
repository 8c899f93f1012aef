"""Export: (ModelConfig, params) -> a Hugging Face model directory (`config.json` and safetensors
in torch layout) that transformers reloads."""
from __future__ import annotations

import glob
import json
import math
import os
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from mopd_jax import models
from mopd_jax.io.hf.config_json import config_to_hf
from mopd_jax.io.hf.layout import _param_specs, _to_hf
from mopd_jax.io.hf.load import _get
from mopd_jax.models import ModelConfig

DEFAULT_MAX_SHARD_BYTES = 5 * 1024 ** 3  # transformers' default max_shard_size ("5GB")


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
