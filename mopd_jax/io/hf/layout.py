"""Tensor layouts: where each param of a ModelConfig lives in a Hugging Face checkpoint, and
how a block of our array maps to the slice of the torch-layout tensor that holds it
(`_read_block`)."""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from mopd_jax.models import ModelConfig

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


def _read_block(handle, name: str, kind: str, *, shape: tuple, index: tuple) -> np.ndarray:
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
