"""The explicit KV cache: a pytree with one {k, v} entry per layer.

Slots are shared by the whole batch (slot `index` is written by every row at once, so a
decode step is one `dynamic_update_slice`), while validity and RoPE positions are per row:
`valid[b, s]` says whether slot s of row b holds a real token. Left-padded prompts of
different lengths therefore decode together exactly as if each were alone.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from mopd_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  layers: tuple  # per layer: {"k": [B, KV, S, hd], "v": [B, KV, S, hd]}
  valid: jax.Array  # [B, S] bool: slot holds a real (non-pad) token
  index: jax.Array  # [] int32: next slot to write

  @property
  def num_slots(self) -> int:
    return self.valid.shape[1]


def init_cache(cfg: ModelConfig, batch_size: int, num_slots: int, *, dtype=None) -> KVCache:
  dtype = cfg.jnp_dtype if dtype is None else dtype
  shape = (batch_size, cfg.num_kv_heads, num_slots, cfg.head_dim)
  layers = tuple({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                 for _ in range(cfg.num_layers))
  return KVCache(layers=layers, valid=jnp.zeros((batch_size, num_slots), bool),
                 index=jnp.zeros((), jnp.int32))
