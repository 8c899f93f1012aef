"""The safetensors files of a model directory (one file, several, or sharded with an index),
opened lazily; pickle-only directories are refused."""
from __future__ import annotations

import glob
import os
from typing import Any, Dict

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors' numpy reader)
from safetensors import safe_open

from mopd_jax.io.hf.config_json import _read_json

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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
