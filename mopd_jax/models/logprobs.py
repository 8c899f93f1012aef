"""Per-token log-probs of given tokens, chunked so that [B, T, V] logits never exist.

This is the function a teacher uses to prefill (score) a trajectory and the student uses in
its loss. Convention shared with the sampler: `out[b, t] = log p(tokens[b, t] | tokens[b, :t])`
and `out[b, 0] = 0` (nothing predicts the first token).

The vocabulary projection runs over the sequence in chunks under `lax.scan`, each chunk
rematerialised (`jax.checkpoint`) in the backward pass, so peak memory holds [B, chunk, V]
instead of [B, T, V].
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from mopd_jax import models
from mopd_jax.models import ModelConfig


class TokenStats(NamedTuple):
  logprobs: jax.Array  # [B, T]
  entropy: Optional[jax.Array] = None  # [B, T] entropy of the predictive distribution
  topk_logprobs: Optional[jax.Array] = None  # [B, T, k]
  topk_ids: Optional[jax.Array] = None  # [B, T, k]
  # [B, T] int32 1-based rank of each given token in its predictive distribution (1 = the
  # most likely; ties share the better rank), 0 at t = 0.
  rank: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class StatsOptions:
  """Which stats of each next token `token_stats_from_hidden` computes: the log-prob always;
  the entropy, the top-k log-probs and ids (`top_k` > 0) and the rank when asked. The
  vocabulary projection runs over `chunk_size` positions at a time."""
  chunk_size: int = 64
  with_entropy: bool = False
  top_k: int = 0
  with_rank: bool = False


def _chunk_stats(cfg, params, h_BxCxD, *, tgt_BxC, with_entropy, top_k, topk_ids_BxCxK,
                 with_rank=False):
  logits = models.logits_from_hidden(cfg, params, h_BxCxD)  # float32 [B, C, V]
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt_logit = jnp.take_along_axis(logits, tgt_BxC[..., None], axis=-1)[..., 0]
  lp = tgt_logit - lse
  out = [lp]
  if with_entropy:
    p = jnp.exp(logits - lse[..., None])
    out.append(lse - jnp.sum(p * logits, axis=-1))
  if top_k:
    if topk_ids_BxCxK is None:  # this model's own top-k
      vals, ids = jax.lax.top_k(logits, top_k)
    else:  # another model's top-k ids (the student scored on the teacher's support)
      ids = topk_ids_BxCxK
      vals = jnp.take_along_axis(logits, ids, axis=-1)
    out += [vals - lse[..., None], ids.astype(jnp.int32)]
  if with_rank:
    out.append(1 + jnp.sum(logits > tgt_logit[..., None], axis=-1, dtype=jnp.int32))
  return tuple(out)


def _chunking(b: int, n: int, chunk_size: int):
  """(C, number of chunks, to_chunks) for n positions: `to_chunks` zero-pads [B, n, ...] to
  a whole number of chunks and lays it out [nchunks, B, C, ...] for `lax.scan`."""
  c = max(1, min(chunk_size, n))
  nchunks = -(-n // c)

  def to_chunks(x):
    x = jnp.pad(x, ((0, 0), (0, nchunks * c - n)) + ((0, 0),) * (x.ndim - 2))
    return jnp.swapaxes(x.reshape(b, nchunks, c, *x.shape[2:]), 0, 1)
  return c, nchunks, to_chunks


def token_stats_from_hidden(cfg: ModelConfig, params, hidden_BxTxD, *, tokens_BxT,
                            options: StatsOptions = StatsOptions(),
                            topk_ids_BxTxK=None) -> TokenStats:
  """Stats of each next token of `tokens_BxT` from final hidden states (see the module
  docstring); `topk_ids_BxTxK`: score the top-k on these ids (another model's top-k)
  instead of this model's own."""
  chunk_size, with_entropy = options.chunk_size, options.with_entropy
  top_k, with_rank = options.top_k, options.with_rank
  cfg, params = models.materialize(cfg, params)
  b, t, d = hidden_BxTxD.shape
  h = hidden_BxTxD[:, :-1]
  tgt = tokens_BxT[:, 1:].astype(jnp.int32)
  ids = None if topk_ids_BxTxK is None else topk_ids_BxTxK[:, 1:]
  n = t - 1
  c, nchunks, to_chunks = _chunking(b, n, chunk_size)
  xs = (to_chunks(h), to_chunks(tgt), None if ids is None else to_chunks(ids))

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def chunk(params, h_c, tgt_c, ids_c):
    return _chunk_stats(cfg, params, h_c, tgt_BxC=tgt_c, with_entropy=with_entropy, top_k=top_k,
                        topk_ids_BxCxK=ids_c, with_rank=with_rank)

  def step(carry, x):
    return carry, chunk(params, *x)

  _, ys = jax.lax.scan(step, None, xs)
  # [nchunks, B, C, ...] -> [B, T-1, ...], then a leading 0 column for position 0.
  def unchunk(y):
    y = jnp.swapaxes(y, 0, 1).reshape(b, nchunks * c, *y.shape[3:])[:, :n]
    return jnp.pad(y, ((0, 0), (1, 0)) + ((0, 0),) * (y.ndim - 2))

  ys = [unchunk(y) for y in ys]
  lp = ys.pop(0)
  ent = ys.pop(0) if with_entropy else None
  tk_lp, tk_ids = (ys.pop(0), ys.pop(0)) if top_k else (None, None)
  rank = ys.pop(0) if with_rank else None
  return TokenStats(lp, ent, tk_lp, tk_ids, rank)


def kl_from_hidden(cfg_p: ModelConfig, params_p, hidden_p_BxTxD, *, cfg_q: ModelConfig, params_q,
                   hidden_q_BxTxD, chunk_size: int = 64, r_max: float = math.inf):
  """[B, T] exact KL(p || q) over the whole vocabulary of each next-token distribution:
  `out[b, t]` compares the two models' predictions of token t (from their hidden states at
  t - 1, which the caller aligns); 0 at t = 0. Chunked like `token_stats_from_hidden`, so
  [B, T, V] logits never exist. Both heads may differ (a student and its teacher).

  With a finite `r_max` the values are the same KL, but the gradient in p's params is
  -sum_y p(y) clip(log q(y) - log p(y), -r_max, r_max) grad log p(y): the expectation over
  y ~ p of K3 eq. 15's per-token gradient with its reward clip (with no clip it is the KL's
  own gradient, since sum_y grad p(y) = 0)."""
  cfg_p, params_p = models.materialize(cfg_p, params_p)
  cfg_q, params_q = models.materialize(cfg_q, params_q)
  b, t, _ = hidden_p_BxTxD.shape
  n = t - 1
  c, nchunks, to_chunks = _chunking(b, n, chunk_size)

  def step(carry, x):
    hp, hq = x
    lp = jax.nn.log_softmax(models.logits_from_hidden(cfg_p, params_p, hp), axis=-1)
    lq = jax.nn.log_softmax(models.logits_from_hidden(cfg_q, params_q, hq), axis=-1)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
    if math.isinf(r_max):
      return carry, kl
    # The KL's value with eq. 15's clipped expected gradient: sg(kl) + (s - sg(s)).
    weight = jax.lax.stop_gradient(jnp.exp(lp) * jnp.clip(lq - lp, -r_max, r_max))
    surrogate = -jnp.sum(weight * lp, axis=-1)
    return carry, (jax.lax.stop_gradient(kl) + surrogate
                   - jax.lax.stop_gradient(surrogate))

  _, ys = jax.lax.scan(step, None, (to_chunks(hidden_p_BxTxD[:, :-1]),
                                    to_chunks(hidden_q_BxTxD[:, :-1])))
  kl = jnp.swapaxes(ys, 0, 1).reshape(b, nchunks * c)[:, :n]
  return jnp.pad(kl, ((0, 0), (1, 0)))


def token_stats(cfg: ModelConfig, params, tokens_BxT, *, input_mask=None, positions=None,
                topk_ids_BxTxK=None, **options) -> TokenStats:
  """Teacher-forced per-token log-probs (and optionally entropy, top-k, rank) of `tokens`.
  `options`: the fields of `StatsOptions` (chunk_size, with_entropy, top_k, with_rank);
  `topk_ids_BxTxK` as in `token_stats_from_hidden`."""
  cfg, params = models.materialize(cfg, params)  # QAT: quantise once for trunk and head
  h = models.hidden_states(cfg, params, tokens_BxT, input_mask=input_mask, positions=positions)
  return token_stats_from_hidden(cfg, params, h, tokens_BxT=tokens_BxT,
                                 options=StatsOptions(**options),
                                 topk_ids_BxTxK=topk_ids_BxTxK)


def token_logprobs(cfg: ModelConfig, params, tokens_BxT, *, input_mask=None, positions=None,
                   chunk_size: int = 64):
  """[B, T] log p(tokens[:, t] | tokens[:, :t]); 0 at t = 0. Pads are masked as keys."""
  return token_stats(cfg, params, tokens_BxT, input_mask=input_mask, positions=positions,
                     chunk_size=chunk_size).logprobs


def full_token_logprobs(cfg: ModelConfig, params, tokens_BxT, *, input_mask=None,
                        positions=None):
  """Reference: the whole [B, T, V] log_softmax, then a gather (tests and benchmark only)."""
  logits = models.forward(cfg, params, tokens_BxT, input_mask=input_mask, positions=positions)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], axis=-1),
                           tokens_BxT[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
  return jnp.pad(lp, ((0, 0), (1, 0)))


def fused_token_loss(cfg: ModelConfig, params, hidden_BxTxD, *, tokens_BxT, loss_fn, aux,
                     chunk_size: int = 64):
  """`loss_fn(token_logprobs [B, T], aux) -> (loss, metrics)` with the head fused into it.

  Same value and gradient as `loss_fn(token_stats_from_hidden(...).logprobs, aux)`, for
  less work: the generic path runs the [B, C, V] vocabulary projection three times per
  chunk in the backward pass (rematerialised forward, then two gradient matmuls) on top of
  the forward one; here each chunk computes its logits once and turns them straight into
  the hidden-state and head-weight gradients, because the cotangent of each token's
  log-prob is already known when its logits exist.

  That last point is the contract: `loss_fn` must be token-separable, i.e. d loss / d lp[b, t]
  depends on lp[b, t] alone (and on `aux`). Masked means with mask-only normalisers,
  stop-gradient rewards and per-token clipped ratios qualify (SFT NLL, the MOPD loss,
  clipped PG); anything pooling log-probs across tokens (PMD's sequence log-ratio) does not.
  `metrics` must already be gradient-stopped. The gradient reaches `hidden_BxTxD` and the
  head weight, hence the embedding when tied.
  """
  cfg, params = models.materialize(cfg, params)
  w_DxV = models.head_weight(cfg, params)
  return _fused_loss(loss_fn, chunk_size, hidden_BxTxD, w_DxV, tokens_BxT.astype(jnp.int32),
                     aux)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused_loss(loss_fn, chunk_size, h_BxTxD, w_DxV, tokens_BxT, aux):
  (loss, metrics), _ = _fused_fwd(loss_fn, chunk_size, h_BxTxD, w_DxV, tokens_BxT, aux)
  return loss, metrics


def _fused_fwd(loss_fn, chunk_size, h_BxTxD, w_DxV, tokens_BxT, aux):
  b, t, d = h_BxTxD.shape
  n = t - 1
  c, nchunks, to_chunks = _chunking(b, n, chunk_size)
  h, tgt = h_BxTxD[:, :-1], tokens_BxT[:, 1:]
  from_chunks = lambda y: jnp.swapaxes(y, 0, 1).reshape(b, nchunks * c, *y.shape[3:])[:, :n]
  # Log-probs live in a [B, 1 + nchunks*C] buffer: column 0 (nothing predicts the first
  # token) stays 0 and column 1 + j holds target j, as in `token_stats_from_hidden`.
  grad_lp = jax.grad(lambda lp, aux: loss_fn(lp[:, :t], aux)[0])

  def chunk(dw, x):
    h_c, tgt_c, i = x
    logits = jnp.dot(h_c.reshape(b * c, d), w_DxV, preferred_element_type=jnp.float32)
    logits = logits.reshape(b, c, -1)
    lse = jax.nn.logsumexp(logits, axis=-1)
    lp_c = jnp.take_along_axis(logits, tgt_c[..., None], axis=-1)[..., 0] - lse
    # This chunk's cotangents: the loss gradient at a probe holding only this chunk's
    # log-probs. Token-separability makes the other (zero) entries irrelevant to them.
    start = 1 + i * c
    probe = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((b, 1 + nchunks * c), jnp.float32),
                                                lp_c, start, axis=1)
    g_c = jax.lax.dynamic_slice_in_dim(grad_lp(probe, aux), start, c, axis=1)
    p = jnp.exp(logits - lse[..., None])
    onehot = jax.nn.one_hot(tgt_c, logits.shape[-1], dtype=jnp.float32)
    dlogits = (g_c[..., None] * (onehot - p)).reshape(b * c, -1)
    dh = jnp.dot(dlogits.astype(w_DxV.dtype), w_DxV.T, preferred_element_type=jnp.float32)
    dw = dw + jnp.dot(h_c.reshape(b * c, d).T.astype(jnp.float32), dlogits)
    return dw, (lp_c, dh.reshape(b, c, d))

  dw, (lp_chunks, dh_chunks) = jax.lax.scan(
      chunk, jnp.zeros(w_DxV.shape, jnp.float32),
      (to_chunks(h), to_chunks(tgt), jnp.arange(nchunks, dtype=jnp.int32)))
  lp = jnp.pad(from_chunks(lp_chunks), ((0, 0), (1, 0)))
  loss, metrics = loss_fn(lp, aux)
  dh = jnp.pad(from_chunks(dh_chunks), ((0, 0), (0, 1), (0, 0)))  # the last position
  return (loss, metrics), (dh.astype(h_BxTxD.dtype), dw.astype(w_DxV.dtype))  # predicts nothing


def _fused_bwd(loss_fn, chunk_size, res, cts):
  del loss_fn, chunk_size
  dh, dw = res
  ct_loss = cts[0]  # metrics are gradient-stopped: their cotangents are ignored
  # A cotangent has its primal's dtype: the float32 loss cotangent would otherwise promote
  # a bfloat16 hidden state's or head's gradient to float32.
  return (ct_loss * dh).astype(dh.dtype), (ct_loss * dw).astype(dw.dtype), None, None


_fused_loss.defvjp(_fused_fwd, _fused_bwd)
