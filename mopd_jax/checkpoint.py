"""Checkpoints: params through orbax, metadata through JSON. No pickle on any load path."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath


def save_params(path: str, params) -> None:
  """Write a params pytree to `path` (a new directory) and wait until it is complete."""
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(epath.Path(path).absolute(), params, force=True)
  ckptr.wait_until_finished()


def load_params(path: str, like=None, sharding=None):
  """Restore params; `like` (a pytree of arrays or ShapeDtypeStructs) fixes the expected tree,
  shapes and dtypes, `sharding` places each leaf (shard by shard) on a mesh."""
  path = epath.Path(path).absolute()
  if not path.exists():
    raise FileNotFoundError(f"no checkpoint at {path}")
  ckptr = ocp.StandardCheckpointer()
  if like is None:
    return ckptr.restore(path)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
  if sharding is not None:
    target = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s),
                          target, sharding)
  return ckptr.restore(path, target)


def write_json(path: str, obj: Any) -> None:
  """Atomic JSON write: a reader never sees a half-written file."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
  os.replace(tmp, path)


def read_json(path: str, default: Optional[Any] = None) -> Any:
  if not os.path.exists(path):
    if default is not None:
      return default
    raise FileNotFoundError(f"missing JSON file {path}")
  with open(path) as f:
    return json.load(f)
