"""Quantisation-aware training: group-wise symmetric fake quantisation with a
straight-through gradient, and a real int4/int8 export.

Written here (about a hundred lines) rather than taken from a library: AQT and Qwix wrap
Flax modules and intercept dots, while this codebase keeps params as a plain pytree and
wants one pure `fake_quantize(params)` applied before any forward (SFT, RL, teacher
prefill, student sampling). The math is the usual one: per group of `group_size` input
weights, scale = max|w| / qmax, q = clip(round(w / scale), -qmax, qmax), w_hat = q * scale.
The gradient passes straight through (d w_hat / d w = 1).

Which params are quantised: every matrix (ndim >= 2: projections, MLP, embedding / head).
Norm scales and biases stay in full precision, as in deployed int4 checkpoints.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MODES = {"none": None, "int8": 127, "int4": 7}


def _check(mode: str, group_size: int):
  if mode not in MODES:
    raise ValueError(f"unknown quantisation mode {mode!r}; known: {sorted(MODES)}")
  if group_size <= 0:
    raise ValueError(f"quantisation group_size must be > 0, got {group_size}")


def _quant_axis(path) -> int:
  """Group along the axis contracted in the matmul: the last for the (tied) embedding
  table, the first (input features) for every projection."""
  return -1 if path and getattr(path[-1], "key", None) == "embed" else 0


def _qdq(w, qmax: int, group_size: int, *, axis: int):
  w32 = w.astype(jnp.float32)
  moved = jnp.moveaxis(w32, axis, -1)
  n = moved.shape[-1]
  g = min(group_size, n)
  if n % g:
    raise ValueError(f"a weight axis of size {n} is not divisible by group_size {g}")
  grouped = moved.reshape(*moved.shape[:-1], n // g, g)
  scale = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True) / qmax
  scale = jnp.where(scale == 0, 1.0, scale)
  q = jnp.clip(jnp.round(grouped / scale), -qmax, qmax)
  return q, scale, moved.shape


def fake_quantize(params, mode: str = "int4", group_size: int = 32):
  """Quantise-dequantise every matrix; straight-through gradient. mode 'none' is identity."""
  _check(mode, group_size)
  qmax = MODES[mode]
  if qmax is None:
    return params

  def one(path, w):
    if w.ndim < 2:
      return w
    q, scale, shape = _qdq(w, qmax, group_size, axis=_quant_axis(path))
    deq = jnp.moveaxis((q * scale).reshape(shape), -1, _quant_axis(path)).astype(w.dtype)
    return w + jax.lax.stop_gradient(deq - w)  # straight-through estimator

  return jax.tree_util.tree_map_with_path(one, params)


def export(params, mode: str = "int4", group_size: int = 32) -> dict:
  """Real integer weights: {path: {"q": int8 array (int4 values packed two per byte for
  int4), "scale": float32, "shape": ..., "axis": ...}} plus float leaves kept as they are."""
  _check(mode, group_size)
  qmax = MODES[mode]
  if qmax is None:
    raise ValueError("export needs an integer mode (int4 or int8)")
  out = {}
  for path, w in jax.tree_util.tree_leaves_with_path(params):
    key = jax.tree_util.keystr(path)
    if w.ndim < 2:
      out[key] = {"float": np.asarray(w)}
      continue
    axis = _quant_axis(path)
    q, scale, shape = _qdq(w, qmax, group_size, axis=axis)
    q = np.asarray(q, np.int8)
    if qmax == 7:  # two signed 4-bit values per byte
      flat = (q.reshape(-1) & 0x0F).astype(np.uint8)
      if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
      q = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)
    out[key] = {"q": q, "scale": np.asarray(scale, np.float32), "moved_shape": shape,
                "axis": axis, "dtype": str(w.dtype), "bits": 4 if qmax == 7 else 8}
  return out


def load_exported(exported: dict, like) -> dict:
  """Dequantise an `export()` result back into a params pytree shaped like `like`."""
  def one(path, w):
    e = exported[jax.tree_util.keystr(path)]
    if "float" in e:
      return jnp.asarray(e["float"], w.dtype)
    shape = tuple(e["moved_shape"])
    if e["bits"] == 4:
      packed = np.asarray(e["q"], np.uint8)
      nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(-1)
      nib = nib[:int(np.prod(shape))].astype(np.int8)
      q = np.where(nib > 7, nib - 16, nib).astype(np.float32)
    else:
      q = np.asarray(e["q"], np.float32)
    g = e["scale"].shape[-2:]
    q = q.reshape(*shape[:-1], g[0], -1)
    deq = (q * e["scale"]).reshape(shape)
    return jnp.moveaxis(jnp.asarray(deq), -1, e["axis"]).astype(w.dtype)

  return jax.tree_util.tree_map_with_path(one, like)
