"""One token per row from a step's logits, and its log-prob under the distribution it was
drawn from (temperature, top-k, top-p applied; greedy is a point mass).

Sampling is by inverse CDF with one uniform per row, done in two levels (blocks of the
vocabulary, then within the block) so that no 32k-wide cumsum or sort runs per step; only
top-p needs a sort, and it is compiled in only when top_p < 1. Each row's uniform is a pure
function of (row key, sequence position of the token).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_CDF_BLOCK = 128


def process_logits(logits, scfg):
  """Logits of the distribution actually sampled from (temperature, top-k, top-p of the
  `sampling.SamplingConfig` `scfg`)."""
  logits = logits.astype(jnp.float32)
  if scfg.temperature != 1.0 and not scfg.is_greedy:
    logits = logits / scfg.temperature
  return _truncate(logits, scfg)


def _truncate(logits, scfg):
  """`logits` with top-k and top-p of `scfg` applied (no-ops when off)."""
  if scfg.top_k and scfg.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, scfg.top_k)[0][:, -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)  # ties at the k-th value are kept
  if scfg.top_p < 1.0:
    srt = -jnp.sort(-logits, axis=-1)
    p = jax.nn.softmax(srt, axis=-1)
    mass_before = jnp.cumsum(p, axis=-1) - p
    keep = jnp.maximum(jnp.sum(mass_before < scfg.top_p, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(srt, keep - 1, axis=-1)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return logits


def inverse_cdf(probs, u):
  """(index i with cdf[i-1] < u * total <= cdf[i], total): by blocks, no full-vocab cumsum.
  The total is the last block's cumulative sum, so the caller needs no second pass."""
  b, v = probs.shape
  nblk = -(-v // _CDF_BLOCK)
  probs = jnp.pad(probs, ((0, 0), (0, nblk * _CDF_BLOCK - v)))
  blocks = probs.reshape(b, nblk, _CDF_BLOCK)
  block_cdf = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)  # [B, nblk]
  target = u * block_cdf[:, -1]
  blk = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), nblk - 1)
  before = jnp.where(blk > 0, jnp.take_along_axis(block_cdf, jnp.maximum(blk - 1, 0)[:, None],
                                                   axis=-1)[:, 0], 0.0)
  inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
  inner_cdf = before[:, None] + jnp.cumsum(inner, axis=-1)
  # The first index reaching the target; skip zero-probability entries that round-off
  # could otherwise select at a block edge.
  hit = (inner_cdf >= target[:, None]) & (inner > 0)
  last_nonzero = _CDF_BLOCK - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
  idx = jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last_nonzero)
  return jnp.minimum(blk * _CDF_BLOCK + idx, v - 1).astype(jnp.int32), block_cdf[:, -1]


def row_uniforms(row_keys, positions):
  """One uniform per row, a pure function of (row key, sequence position of the token)."""
  return jax.vmap(lambda k, p: jax.random.uniform(
      jax.random.fold_in(k, p), (), jnp.float32, minval=1e-7, maxval=1.0))(row_keys, positions)


def uniform_table(row_keys, first_positions, n: int):
  """[B, n]: column j holds `row_uniforms(row_keys, first_positions + j)`. Drawn for the whole
  decode before it starts, in one vectorised pass, instead of a small threefry loop in every
  decode step."""
  cols = first_positions[:, None] + jnp.arange(n, dtype=first_positions.dtype)[None, :]
  return jax.vmap(row_uniforms, in_axes=(None, 1), out_axes=1)(row_keys, cols)


def sample_token(logits, u, scfg):
  """One token per row and its log-prob under the sampled-from distribution.

  `u` [B]: each row's uniform draw in (0, 1) (see `row_uniforms`); `scfg`: the
  `sampling.SamplingConfig`.
  """
  if scfg.is_greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros(logits.shape[:1], jnp.float32)
  return _draw(process_logits(logits, scfg), u)


def _draw(logits, u):
  """(token, its log-prob) drawn by `u` from the distribution of the processed `logits`."""
  m = jnp.max(logits, axis=-1, keepdims=True)
  tok, total = inverse_cdf(jnp.exp(logits - m), u)
  picked = jnp.take_along_axis(logits, tok[:, None], axis=-1)[:, 0]
  return tok, picked - m[:, 0] - jnp.log(total)


def sample_token_at(logits, u, scfg, *, temperature):
  """`sample_token` at a runtime `temperature` (a float32 scalar; <= 0 = greedy) instead of
  `scfg`'s, whose temperature and greedy flag are ignored (top-k and top-p still apply).

  One program then serves every temperature: the continuous sampler compiles its programs
  once for greedy evaluation, sampling at 1 and a teacher's sampling at 0.5. Token for
  token and bit for bit what `sample_token` gives with `scfg` at that temperature: the
  division by 1 is exact, and a greedy row takes the argmax of the raw logits with
  log-prob 0."""
  greedy = temperature <= 0.0
  raw = logits.astype(jnp.float32)
  scaled = _truncate(raw / jnp.where(greedy, 1.0, temperature).astype(jnp.float32), scfg)
  tok, lp = _draw(scaled, u)
  top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jnp.where(greedy, top, tok), jnp.where(greedy, 0.0, lp)
