"""Losses for on-policy distillation and SFT, and the masked reductions every loss shares
(RL fine-tuning's losses: mopd_jax/training/rl_losses.py).

Conventions shared by every function here:

* Per-token arrays are ``[B, T]`` and aligned with the tokens:
  ``logprobs[b, t] = log p(tokens[b, t] | tokens[b, :t])``.
* ``loss_mask[b, t]`` is true exactly on tokens the policy generated; prompt,
  padding and tool-observation tokens are false. Values under a false mask may
  be anything, NaN and inf included: they are replaced with ``jnp.where``
  before any arithmetic, so they reach neither the loss nor the gradient.
* Token losses are averaged within a row (``1/|y_i|``) and then over the rows
  that hold at least one token, so the loss does not depend on how much
  padding a batch carries, on which side, or on extra empty rows.
* Hyper-parameters (``r_max``, ``eps_*``, ...) are static Python numbers,
  validated eagerly, so a bad value fails at trace time rather than as NaN.
* Metrics are float32 scalars with the gradient stopped.
"""
from __future__ import annotations

import numbers
from typing import Optional

import jax
import jax.numpy as jnp

Array = jax.Array
Metrics = dict[str, Array]

# Floor for top-k log-probs: a zero probability (-inf, e.g. padded vocab)
# would otherwise turn p * log p into 0 * inf = NaN.
_TOPK_LOGPROB_FLOOR = -1e3


# ----------------------------------------------------------------------------
# Validation and masked reductions.
# ----------------------------------------------------------------------------


def static_float(name: str, value) -> float:
  try:
    return float(value)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    # A traced hyper-parameter cannot be validated; say so instead of letting
    # JAX's generic concretisation error surface.
    raise TypeError(
        f"{name} must be a static Python number, got {value!r}; pass it as a "
        "static argument or close over it when jitting") from e


def positive(name: str, value) -> float:
  v = static_float(name, value)
  if not v > 0:  # also rejects NaN
    raise ValueError(f"{name} must be > 0, got {value!r}")
  return v


def non_negative(name: str, value) -> float:
  v = static_float(name, value)
  if not v >= 0:  # also rejects NaN
    raise ValueError(f"{name} must be >= 0, got {value!r}")
  return v


def same_shapes(ndim: Optional[int], **arrays) -> tuple[int, ...]:
  shapes = {name: tuple(jnp.shape(a)) for name, a in arrays.items()}
  first = next(iter(shapes.values()))
  if any(s != first for s in shapes.values()):
    raise ValueError(f"shape mismatch: {shapes}")
  if ndim is not None and len(first) != ndim:
    raise ValueError(f"expected {ndim}-D arrays, got shapes {shapes}")
  return first


def f32(x) -> Array:
  return jnp.asarray(x).astype(jnp.float32)


def as_mask(mask) -> Array:
  return jnp.asarray(mask).astype(bool)


def token_mean(x_BxT: Array, mask_BxT: Array) -> Array:
  total = jnp.sum(jnp.where(mask_BxT, x_BxT, 0.0))
  count = jnp.sum(mask_BxT, dtype=jnp.float32)
  return total / jnp.maximum(count, 1.0)


def row_normalised_mean(x_BxT: Array, mask_BxT: Array):
  """mean over non-empty rows i of (1/|y_i|) sum_t x[i, t]; 0 if no tokens.

  Returns (value, num_tokens, num_rows). Empty rows get weight 0 through a
  select, and the divisors are clamped to 1, so no 0/0 appears in the forward
  or backward pass.
  """
  n_tok_B = jnp.sum(mask_BxT, axis=-1, dtype=jnp.float32)
  has_tok_B = n_tok_B > 0
  n_rows = jnp.sum(has_tok_B, dtype=jnp.float32)
  row_sum_B = jnp.sum(jnp.where(mask_BxT, x_BxT, 0.0), axis=-1)
  row_mean_B = row_sum_B / jnp.maximum(n_tok_B, 1.0)
  value = jnp.sum(jnp.where(has_tok_B, row_mean_B, 0.0)) / jnp.maximum(
      n_rows, 1.0)
  return value, jnp.sum(n_tok_B), n_rows


def stop(metrics: Metrics) -> Metrics:
  return {k: jax.lax.stop_gradient(f32(v)) for k, v in metrics.items()}


# ----------------------------------------------------------------------------
# MOPD (Kimi K3 eq. 15).
# ----------------------------------------------------------------------------


def _mopd_inputs(student_logprobs, teacher_logprobs, loss_mask, *, r_max):
  r_max = positive("r_max", r_max)
  same_shapes(2, student_logprobs=student_logprobs,
               teacher_logprobs=teacher_logprobs, loss_mask=loss_mask)
  mask_BxT = as_mask(loss_mask)
  # Sanitise first: where() only protects the gradient if nothing non-finite
  # is ever multiplied, even by a cotangent of zero.
  lp_s_BxT = jnp.where(mask_BxT, f32(student_logprobs), 0.0)
  lp_t_BxT = jnp.where(mask_BxT, f32(teacher_logprobs), 0.0)
  return lp_s_BxT, lp_t_BxT, mask_BxT, r_max


def _reward(lp_s_BxT, lp_t_BxT, mask_BxT, *, r_max):
  gap_BxT = jax.lax.stop_gradient(lp_t_BxT - lp_s_BxT)
  r_BxT = jnp.where(mask_BxT, jnp.clip(gap_BxT, -r_max, r_max), 0.0)
  return r_BxT, gap_BxT


def mopd_reward(student_logprobs, teacher_logprobs, loss_mask,
                *, r_max: float) -> Array:
  """Per-token MOPD reward ``clip(lp_T - lp_S, -r_max, r_max)``, [B, T].

  Zero on masked tokens and gradient-stopped, so it can be used directly as a
  per-token advantage.
  """
  lp_s, lp_t, mask, r_max = _mopd_inputs(student_logprobs, teacher_logprobs,
                                         loss_mask, r_max=r_max)
  return _reward(lp_s, lp_t, mask, r_max=r_max)[0]


def truncated_importance_weights(student_logprobs, sampler_logprobs, loss_mask,
                                 *, low: float, high: float) -> Array:
  """``clip(exp(lp_S - lp_sampler), low, high)`` per token, gradient-stopped, 0 off-mask.

  Corrects a batch sampled by an older student (asynchronous teacher scoring: one step
  stale) toward the current one; the truncation bounds the variance (NeMo-RL's MOPD recipe).
  The log-ratio is clipped before `exp` so a wild token cannot overflow.
  """
  if not 0.0 <= low <= 1.0 <= high:
    raise ValueError(f"importance weight bounds must satisfy 0 <= low <= 1 <= high, got "
                     f"low={low}, high={high}")
  log_ratio = jax.lax.stop_gradient(f32(student_logprobs) - f32(sampler_logprobs))
  w = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
  return jnp.where(loss_mask, jnp.clip(w, low, high), 0.0)


def mopd_loss(student_logprobs, teacher_logprobs, loss_mask,
              *, r_max: float, importance_weights=None) -> tuple[Array, Metrics]:
  """Kimi K3 eq. 15: ``-mean_i (1/|y_i|) sum_t r_t * lp_S_t``.

  ``importance_weights`` [B, T] (optional, constant): per-token weights ``w_t`` of an
  off-policy batch, giving ``-mean_i (1/|y_i|) sum_t w_t r_t lp_S_t``; None = on-policy.

  ``r_t = clip(sg(lp_T_t - lp_S_t), -r_max, r_max)``. The gradient is the
  REINFORCE estimator of the reverse KL to the teacher with a bounded
  per-token reward; it flows through ``student_logprobs`` only.

  Metrics: ``kl`` (token mean of ``lp_S - lp_T``, the sampled-token estimate
  of KL(student || teacher)), ``reward_mean``, ``clip_frac`` (tokens with
  ``|lp_T - lp_S| > r_max``), ``num_tokens``, ``num_rows`` (rows with at
  least one token).
  """
  lp_s, lp_t, mask, r_max = _mopd_inputs(student_logprobs, teacher_logprobs,
                                         loss_mask, r_max=r_max)
  r_BxT, gap_BxT = _reward(lp_s, lp_t, mask, r_max=r_max)
  weighted = r_BxT if importance_weights is None else (
      r_BxT * jax.lax.stop_gradient(f32(importance_weights)))
  objective, n_tokens, n_rows = row_normalised_mean(weighted * lp_s, mask)
  metrics = {
      "kl": token_mean(-gap_BxT, mask),
      "reward_mean": token_mean(r_BxT, mask),
      "clip_frac": token_mean(
          (jnp.abs(gap_BxT) > r_max).astype(jnp.float32), mask),
      "num_tokens": n_tokens,
      "num_rows": n_rows,
  }
  return -objective, stop(metrics)


def mopd_advantages(student_logprobs, teacher_logprobs, loss_mask,
                    *, r_max: float, outcome_advantage=None,
                    alpha=0.0) -> Array:
  """MOPD reward plus an optional sequence-level outcome term, [B, T].

  ``r_t + alpha * outcome_advantage[b]`` on masked tokens, 0 elsewhere,
  gradient-stopped: the advantage to feed ``pg_loss`` so that distillation
  and outcome RL share one clipped policy-gradient step.
  """
  lp_s, lp_t, mask, r_max = _mopd_inputs(student_logprobs, teacher_logprobs,
                                         loss_mask, r_max=r_max)
  r_BxT, _ = _reward(lp_s, lp_t, mask, r_max=r_max)
  if outcome_advantage is None:
    # A non-zero alpha with nothing to scale is almost surely a wiring bug.
    if isinstance(alpha, numbers.Real) and alpha != 0:
      raise ValueError(
          f"alpha={alpha!r} is non-zero but outcome_advantage is None")
    return r_BxT
  if tuple(jnp.shape(outcome_advantage)) != mask.shape[:1]:
    raise ValueError(
        f"outcome_advantage must have shape {mask.shape[:1]} (one value per "
        f"row of loss_mask {mask.shape}), got {jnp.shape(outcome_advantage)}")
  out_B = jax.lax.stop_gradient(f32(outcome_advantage))
  adv_BxT = r_BxT + jax.lax.stop_gradient(f32(alpha)) * out_B[:, None]
  return jnp.where(mask, adv_BxT, 0.0)


# ----------------------------------------------------------------------------
# Top-k (logit-level) distillation.
# ----------------------------------------------------------------------------


def _topk_inputs(student_topk_logprobs, teacher_topk_logprobs, loss_mask) -> tuple:
  """(mask [B, T], the student's and the teacher's top-k log-probs [B, T, k]) checked for
  shape, 0 off the mask and floored at -1e3 (so zero probabilities stay finite), the
  teacher's a constant of the gradient."""
  shape = same_shapes(3, student_topk_logprobs=student_topk_logprobs,
                       teacher_topk_logprobs=teacher_topk_logprobs)
  if tuple(jnp.shape(loss_mask)) != shape[:2]:
    raise ValueError(f"loss_mask must have shape {shape[:2]} to match top-k "
                     f"log-probs {shape}, got {jnp.shape(loss_mask)}")
  mask = as_mask(loss_mask)
  m = mask[..., None]
  lp_s = jnp.maximum(jnp.where(m, f32(student_topk_logprobs), 0.0), _TOPK_LOGPROB_FLOOR)
  lp_t = jax.lax.stop_gradient(
      jnp.maximum(jnp.where(m, f32(teacher_topk_logprobs), 0.0), _TOPK_LOGPROB_FLOOR))
  return mask, lp_s, lp_t


def topk_kl_loss(student_topk_logprobs, teacher_topk_logprobs,
                 loss_mask) -> tuple[Array, Metrics]:
  """Reverse KL restricted to the teacher's top-k tokens, row-normalised.

  Both inputs are [B, T, k] log-probs of the same ids (the teacher's top-k).
  Per token: ``sum_v p_s (log p_s - log p_t) - p_s + p_t``. The ``- p_s + p_t``
  terms make each summand a Bregman divergence of unnormalised measures,
  which is >= 0 and minimised exactly at ``p_s = p_t`` even though neither
  distribution sums to 1 over k tokens; without them the truncated KL would
  reward pushing student mass off the top-k set. Gradient flows through the
  student only. Log-probs are floored at -1e3 so zero probabilities (-inf)
  stay finite.

  Metrics: ``kl`` (token mean of the per-token loss), ``student_topk_mass``,
  ``teacher_topk_mass`` (token means of sum_v p), ``num_tokens``,
  ``num_rows``.
  """
  mask_BxT, lp_s, lp_t = _topk_inputs(student_topk_logprobs, teacher_topk_logprobs, loss_mask)
  p_s, p_t = jnp.exp(lp_s), jnp.exp(lp_t)
  kl_BxT = jnp.sum(p_s * (lp_s - lp_t) - p_s + p_t, axis=-1)
  loss, n_tokens, n_rows = row_normalised_mean(kl_BxT, mask_BxT)
  metrics = {
      "kl": token_mean(kl_BxT, mask_BxT),
      "student_topk_mass": token_mean(jnp.sum(p_s, axis=-1), mask_BxT),
      "teacher_topk_mass": token_mean(jnp.sum(p_t, axis=-1), mask_BxT),
      "num_tokens": n_tokens,
      "num_rows": n_rows,
  }
  return loss, stop(metrics)


def forward_topk_kl_loss(student_topk_logprobs, teacher_topk_logprobs,
                         loss_mask) -> tuple[Array, Metrics]:
  """Forward KL(teacher || student) on the teacher's top-k tokens, a mean over every
  loss-mask token (SFT's weighting, `nll_loss`): the soft-target form of SFT on a teacher's
  own trajectories, each position matched to the teacher's whole next-token distribution
  rather than to the one token it sampled.

  Both inputs are [B, T, k] log-probs of the same ids (the teacher's top-k). Per token:
  ``sum_v p_t (log p_t - log p_s)``. With k the vocabulary it is the exact forward KL; with
  a smaller k its minimum is the teacher's distribution renormalised on its top-k (the
  gradient in the student's logits is ``M p_s - p_t`` on the top-k, M the teacher's mass
  there). Gradient flows through the student only; log-probs are floored at -1e3.

  Metrics: ``forward_kl`` (the value), ``teacher_topk_mass`` (token mean of sum_v p_t),
  ``num_tokens``, ``num_rows``.
  """
  mask, lp_s, lp_t = _topk_inputs(student_topk_logprobs, teacher_topk_logprobs, loss_mask)
  p_t = jnp.where(mask[..., None], jnp.exp(lp_t), 0.0)
  kl_BxT = jnp.sum(p_t * (lp_t - lp_s), axis=-1)
  value = token_mean(kl_BxT, mask)
  return value, stop({"forward_kl": value,
                      "teacher_topk_mass": token_mean(jnp.sum(p_t, axis=-1), mask),
                      "num_tokens": jnp.sum(mask, dtype=jnp.float32),
                      "num_rows": jnp.sum(jnp.any(mask, axis=-1), dtype=jnp.float32)})


KL_REDUCTIONS = ("row", "token")  # token_kl_loss's `per`: eq. 15's 1/|y|, or a token mean


def token_kl_loss(kl_BxT, loss_mask, *, per: str = "row") -> tuple[Array, Metrics]:
  """A per-token KL computed exactly per position (`vocab_kl.py`: the whole vocabulary
  against the routed teacher) reduced over the masked tokens: `per="row"`, the mean over
  rows of each row's mean (eq. 15's 1/|y| and row weights: every rollout weighs the same);
  `per="token"`, the mean over every token of the batch (a rollout weighs its length, as
  in the held-out per-token KL). Metrics: ``kl_vocab`` (its token mean), ``num_tokens``,
  ``num_rows``."""
  same_shapes(2, kl_BxT=kl_BxT, loss_mask=loss_mask)
  if per not in KL_REDUCTIONS:
    raise ValueError(f"token_kl_loss: per must be one of {KL_REDUCTIONS}, got {per!r}")
  mask = as_mask(loss_mask)
  kl = jnp.where(mask, f32(kl_BxT), 0.0)
  loss, n_tokens, n_rows = row_normalised_mean(kl, mask)
  if per == "token":
    loss = token_mean(kl, mask)
  return loss, stop({"kl_vocab": token_mean(kl, mask), "num_tokens": n_tokens,
                      "num_rows": n_rows})


__all__ = ["mopd_reward", "mopd_loss", "mopd_advantages", "topk_kl_loss", "token_kl_loss",
           "forward_topk_kl_loss", "nll_loss"]


# ----------------------------------------------------------------------------
# Supervised fine-tuning.
# ----------------------------------------------------------------------------


def nll_loss(logprobs, loss_mask) -> tuple[Array, Metrics]:
  """SFT negative log-likelihood: the mean over every loss-mask token of the batch.

  Unlike the RL and distillation losses (1/|y| per row, K3 eq. 15), SFT weighs every
  token the same. A per-row mean would give each token of a 5-token direct answer 12x the
  weight of a token of a 61-token tool-use trace: the model would then learn the short
  styles' first tokens at about twice their data frequency and the long traces slowly.
  Prompt tokens are outside ``loss_mask`` and so are never trained on.
  """
  same_shapes(2, logprobs=logprobs, loss_mask=loss_mask)
  mask = as_mask(loss_mask)
  nll = -jnp.where(mask, f32(logprobs), 0.0)
  value = token_mean(nll, mask)
  return value, stop({"nll": value, "num_tokens": jnp.sum(mask, dtype=jnp.float32),
                       "num_rows": jnp.sum(jnp.any(mask, axis=-1), dtype=jnp.float32)})
