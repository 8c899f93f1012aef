"""Meshes and shardings, said once.

Params carry logical axis names (see `models.param_logical_axes`); the config maps logical
names to mesh axes (`DEFAULT_RULES`); this module turns the two into `NamedSharding`s. The
pattern for any state: `jax.eval_shape` -> shardings -> `jax.jit(init, out_shardings=...)`,
so no host ever holds an unsharded copy.

Mesh axes: `data` and `fsdp` split the batch (fsdp also splits params), `tensor` splits
heads / MLP / vocabulary, `teacher` splits the stacked teacher bank (one teacher per slice).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mopd_jax import models
from mopd_jax.config import choices

MESH_AXES = choices.MESH_AXES
BATCH_AXES = ("data", "fsdp")

# logical axis name -> mesh axis (or tuple of mesh axes, or None = replicated)
DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("teacher", "teacher"),
)


def make_mesh(shape: Mapping[str, int], devices: Optional[Sequence] = None) -> Mesh:
  """A mesh with axes in MESH_AXES order; axes left out have size 1.

  Raises ValueError (before anything compiles) when the product of the axis sizes differs
  from the number of devices or an axis name is unknown.
  """
  devices = list(jax.devices() if devices is None else devices)
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"unknown mesh axes {unknown}; known: {MESH_AXES}")
  sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
  if any(s < 1 for s in sizes):
    raise ValueError(f"mesh axis sizes must be >= 1, got {dict(zip(MESH_AXES, sizes))}")
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but "
                     f"{len(devices)} are available")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def _axis_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(logical: P, shape, mesh: Mesh, *, rules=DEFAULT_RULES) -> P:
  """Map a logical PartitionSpec to mesh axes; a dim that does not divide stays replicated,
  and a mesh axis is used at most once per array."""
  table = dict(rules)
  used, out = set(), []
  for name, dim in zip(logical, shape):
    axes = table.get(name)
    axes_t = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    axes_t = tuple(a for a in axes_t if a not in used and mesh.shape.get(a, 1) > 1)
    if axes_t and dim % _axis_size(mesh, axes_t) == 0:
      used.update(axes_t)
      out.append(axes_t[0] if len(axes_t) == 1 else axes_t)
    else:
      out.append(None)
  return P(*out)


def param_shardings(cfg: models.ModelConfig, mesh: Mesh, rules=DEFAULT_RULES,
                    *, num_stacked: Optional[int] = None):
  """NamedSharding of every param. `num_stacked=K`: params stacked on a leading `teacher`
  axis of size K (the teacher bank)."""
  logical = models.param_logical_axes(cfg)
  shapes = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))

  def one(spec, shape):
    if num_stacked is None:
      return NamedSharding(mesh, logical_to_spec(spec, shape.shape, mesh, rules=rules))
    return NamedSharding(mesh, logical_to_spec(P("teacher", *spec),
                                               (num_stacked,) + tuple(shape.shape), mesh,
                                               rules=rules))

  return jax.tree.map(one, logical, shapes, is_leaf=lambda x: isinstance(x, P))


def init_sharded_params(cfg: models.ModelConfig, rng, mesh: Mesh, *, rules=DEFAULT_RULES):
  """Params initialised directly into their shards."""
  return models.init_params(cfg, rng, out_shardings=param_shardings(cfg, mesh, rules))


def batch_spec(ndim: int, leading: tuple = ()) -> P:
  """[B, ...] arrays split over the batch axes; `leading=("teacher",)` for [K, b, ...]."""
  return P(*leading, BATCH_AXES, *([None] * (ndim - 1 - len(leading))))


def batch_sharding(mesh: Mesh, ndim: int, leading: tuple = ()) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(ndim, leading))


def batch_devices(mesh: Mesh) -> int:
  """How many ways the batch axes (data x fsdp) split a batch's rows."""
  return _axis_size(mesh, BATCH_AXES)


def check_batch_divisible(batch_size: int, mesh: Mesh, what: str = "batch") -> None:
  n = batch_devices(mesh)
  if batch_size % n:
    raise ValueError(f"{what} size {batch_size} is not divisible by the data x fsdp mesh "
                     f"size {n} (mesh {dict(mesh.shape)})")


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
