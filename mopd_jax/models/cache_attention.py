"""Attention against an explicit KV cache: a chunk's k / v written at its slots, and queries
run against the cache blockwise (online softmax) up to the last slot written, so a step's
cost follows the filled length, not the cache size."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def decode_attention(qg, k, v, *, kv_mask, q_slots, block: int):
  """Queries against the cache in blocks up to the last query's slot (online softmax).

  qg [B, KV, G, T, hd]; k, v [B, KV, S, hd]; kv_mask [B, S]; q_slots [T] (increasing), or
  [B, T] when each row writes at its own slots (continuous batching): each query's slot,
  attending causally to slots <= its own. Returns [B, KV, G, T, hd] in v's dtype: the dense
  path's result up to float reassociation. Blocks past the last query's slot (the batch's
  furthest row) are never read (a prefill into a large cache reads only the blocks it
  fills); for a row that ends earlier they are fully masked, which leaves its running
  softmax bit for bit unchanged. A last block that would run past the cache is shifted
  back and its already-counted slots masked."""
  b, kvh, g, t, hd = qg.shape
  s = k.shape[2]
  f32 = jnp.float32
  scale = 1.0 / math.sqrt(hd)
  q2 = query_slots(q_slots)  # [1 or B, T]

  def body(i, carry):
    m, l, acc = carry
    start = jnp.minimum(i * block, s - block)
    kb = jax.lax.dynamic_slice_in_dim(k, start, block, axis=2)
    vb = jax.lax.dynamic_slice_in_dim(v, start, block, axis=2)
    slots = start + jnp.arange(block)
    ok = (jax.lax.dynamic_slice_in_dim(kv_mask, start, block, axis=1)[:, None, :] &
          (slots >= i * block)[None, None, :] & (slots[None, None, :] <= q2[:, :, None]))
    sc = jnp.einsum("bkgth,bksh->bkgts", qg, kb).astype(f32) * scale
    sc = jnp.where(ok[:, None, None], sc, -jnp.inf)  # [B, KV, G, T, block]
    m_new = jnp.maximum(m, sc.max(axis=-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(sc - safe[..., None])
    corr = jnp.exp(m - safe)
    l = l * corr + p.sum(axis=-1)
    acc = acc * corr[..., None] + jnp.einsum("bkgts,bksh->bkgth", p.astype(v.dtype),
                                             vb).astype(f32)
    return m_new, l, acc

  init = (jnp.full((b, kvh, g, t), -jnp.inf, f32), jnp.zeros((b, kvh, g, t), f32),
          jnp.zeros((b, kvh, g, t, hd), f32))
  _, l, acc = jax.lax.fori_loop(0, jnp.max(q2[:, -1]) // block + 1, body, init)
  return (acc / jnp.maximum(l, 1e-30)[..., None]).astype(v.dtype)


def query_slots(q_slots):
  """Query slots as [1, T] (shared by the batch) or [B, T] (one row's own slots)."""
  q_slots = jnp.asarray(q_slots)
  return q_slots[None] if q_slots.ndim == 1 else q_slots


def write_slots(cache_kv, new_kv, q_slots):
  """Write a chunk's k or v [B, KV, T, hd] into the cache [B, KV, S, hd] at its slots: one
  `dynamic_update_slice` for shared slots [T], one per row for per-row slots [B, T]."""
  new_kv = new_kv.astype(cache_kv.dtype)
  if q_slots.ndim == 1:
    return jax.lax.dynamic_update_slice_in_dim(cache_kv, new_kv, q_slots[0], axis=2)
  return jax.vmap(lambda c, n, st: jax.lax.dynamic_update_slice_in_dim(c, n, st, axis=1))(
      cache_kv, new_kv, q_slots[:, 0])
