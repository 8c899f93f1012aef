"""Losses of RL fine-tuning: the clipped importance-ratio policy gradient (PPO / GRPO style,
with asymmetric "clip-higher"), Kimi K1.5 / K2's policy mirror descent on sequence log-probs,
and GRPO's group-normalised advantages. The conventions (masks, row means, static
hyper-parameters, stopped metrics) are mopd_jax/training/losses.py's, whose masked reductions
these share.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from mopd_jax.training.losses import (Array, Metrics, as_mask, f32, non_negative, positive,
                                      row_normalised_mean, same_shapes, stop, token_mean)


# ----------------------------------------------------------------------------
# Clipped importance-ratio policy gradient (PPO / GRPO style).
# ----------------------------------------------------------------------------


def pg_loss(logprobs, sampler_logprobs, advantages, *, loss_mask, eps_low: float = 0.2,
            eps_high: float = 0.2,
            log_ratio_clip: float = 20.0) -> tuple[Array, Metrics]:
  """Clipped surrogate ``-mean_i (1/|y_i|) sum_t min(rho A, clip(rho) A)``.

  ``rho = exp(clip(lp - sg(lp_old), +-log_ratio_clip))`` and
  ``clip(rho) = clip(rho, 1 - eps_low, 1 + eps_high)``; ``eps_high > eps_low``
  gives the DAPO "clip-higher" variant. Row normalisation matches
  ``mopd_loss``, so with ``sampler_logprobs == logprobs`` and
  ``advantages = mopd_reward(...)`` both losses have the same gradient.

  Metrics: ``ratio_mean``, ``clip_frac`` (tokens whose surrogate is clipped,
  i.e. has no gradient), ``approx_kl`` (token mean of ``lp_old - lp``),
  ``advantage_mean``, ``num_tokens``, ``num_rows``.
  """
  eps_low = non_negative("eps_low", eps_low)
  eps_high = non_negative("eps_high", eps_high)
  log_ratio_clip = positive("log_ratio_clip", log_ratio_clip)
  same_shapes(2, logprobs=logprobs, sampler_logprobs=sampler_logprobs,
               advantages=advantages, loss_mask=loss_mask)
  mask = as_mask(loss_mask)
  lp = jnp.where(mask, f32(logprobs), 0.0)
  lp_old = jax.lax.stop_gradient(jnp.where(mask, f32(sampler_logprobs), 0.0))
  adv = jax.lax.stop_gradient(jnp.where(mask, f32(advantages), 0.0))

  log_ratio = lp - lp_old
  ratio = jnp.exp(jnp.clip(log_ratio, -log_ratio_clip, log_ratio_clip))
  # min(rho A, clip(rho) A) written as an explicit select: identical values,
  # but at rho == 1 the gradient is exactly A instead of depending on how
  # jnp.minimum / jnp.clip split ties (e.g. eps_low == 0).
  clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | (
      (adv < 0) & (ratio < 1.0 - eps_low))
  clipped_ratio = jax.lax.stop_gradient(
      jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  obj = jnp.where(clipped, clipped_ratio * adv, ratio * adv)
  objective, n_tokens, n_rows = row_normalised_mean(obj, mask)
  metrics = {
      "ratio_mean": token_mean(ratio, mask),
      "clip_frac": token_mean(clipped.astype(jnp.float32), mask),
      "approx_kl": token_mean(-log_ratio, mask),
      "advantage_mean": token_mean(adv, mask),
      "num_tokens": n_tokens,
      "num_rows": n_rows,
  }
  return -objective, stop(metrics)


# ----------------------------------------------------------------------------
# Kimi K1.5 / K2 policy mirror descent and GRPO advantages.
# ----------------------------------------------------------------------------


def sequence_logprobs(logprobs, loss_mask) -> Array:
  """Sum of log-probs over each row's masked tokens: [..., T] -> [...]."""
  same_shapes(None, logprobs=logprobs, loss_mask=loss_mask)
  if jnp.ndim(logprobs) < 1:
    raise ValueError(f"logprobs must be at least 1-D, got shape "
                     f"{jnp.shape(logprobs)}")
  mask = as_mask(loss_mask)
  return jnp.sum(jnp.where(mask, f32(logprobs), 0.0), axis=-1)


def pmd_loss(seq_logprobs_new, seq_logprobs_old, rewards, *, tau_kl: float, loss_mask=None,
             token_clip: Optional[float] = None) -> tuple[Array, Metrics]:
  """Kimi K1.5 policy mirror descent loss for K samples per prompt.

  ``L = mean_p 1/K sum_i (r_pi - mean_j r_pj - tau_kl * log_ratio_pi)^2``
  with ``log_ratio = log pi_new(y|x) - log pi_old(y|x)``; ``rewards`` and the
  old log-probs are constants.

  Sequence form (``loss_mask=None``): ``seq_logprobs_*`` and ``rewards`` are
  [P, K] (see ``sequence_logprobs``).

  Per-token form (``loss_mask`` given): ``seq_logprobs_*`` and ``loss_mask``
  are token-level [P, K, T] (a flat [B, T] batch with prompt-major rows is
  ``x.reshape(P, K, T)``) and ``log_ratio = sum_t clip(lp_new_t - lp_old_t,
  +-token_clip)`` over masked tokens. Clipping each token (K2.5 style) stops
  a few tokens with a large train/inference mismatch from dominating the
  sequence log-ratio of a long response; a clipped token gets no gradient.
  ``token_clip=None`` sums the unclipped log-ratios.

  Metrics: ``log_ratio_mean``, ``log_ratio_abs_max`` (sequence level),
  ``reward_mean``, ``advantage_abs_mean`` (``|r - mean_j r|``),
  ``token_clip_frac`` (0 in the sequence form).
  """
  tau_kl = positive("tau_kl", tau_kl)
  if loss_mask is None:
    if token_clip is not None:
      raise ValueError(f"token_clip={token_clip!r} needs the per-token form "
                       "(pass loss_mask and [P, K, T] log-probs)")
    same_shapes(2, seq_logprobs_new=seq_logprobs_new,
                 seq_logprobs_old=seq_logprobs_old, rewards=rewards)
    log_ratio_PxK = f32(seq_logprobs_new) - jax.lax.stop_gradient(
        f32(seq_logprobs_old))
    token_clip_frac = jnp.zeros((), jnp.float32)
  else:
    same_shapes(3, seq_logprobs_new=seq_logprobs_new,
                 seq_logprobs_old=seq_logprobs_old, loss_mask=loss_mask)
    if tuple(jnp.shape(rewards)) != tuple(jnp.shape(loss_mask))[:2]:
      raise ValueError(
          f"rewards must have shape {tuple(jnp.shape(loss_mask))[:2]} to "
          f"match loss_mask {jnp.shape(loss_mask)}, got {jnp.shape(rewards)}")
    mask = as_mask(loss_mask)
    lp_new = jnp.where(mask, f32(seq_logprobs_new), 0.0)
    lp_old = jax.lax.stop_gradient(
        jnp.where(mask, f32(seq_logprobs_old), 0.0))
    tok_ratio = lp_new - lp_old
    if token_clip is None:
      token_clip_frac = jnp.zeros((), jnp.float32)
    else:
      c = positive("token_clip", token_clip)
      token_clip_frac = token_mean(
          (jnp.abs(tok_ratio) > c).astype(jnp.float32), mask)
      tok_ratio = jnp.clip(tok_ratio, -c, c)
    log_ratio_PxK = jnp.sum(jnp.where(mask, tok_ratio, 0.0), axis=-1)

  r_PxK = jax.lax.stop_gradient(f32(rewards))
  adv_PxK = r_PxK - jnp.mean(r_PxK, axis=-1, keepdims=True)
  residual_PxK = adv_PxK - tau_kl * log_ratio_PxK
  loss = jnp.mean(jnp.mean(residual_PxK**2, axis=-1))
  metrics = {
      "log_ratio_mean": jnp.mean(log_ratio_PxK),
      "log_ratio_abs_max": jnp.max(jnp.abs(log_ratio_PxK)),
      "reward_mean": jnp.mean(r_PxK),
      "advantage_abs_mean": jnp.mean(jnp.abs(adv_PxK)),
      "token_clip_frac": token_clip_frac,
  }
  return loss, stop(metrics)


def grpo_advantages(rewards, eps: float = 1e-6,
                    normalize_std: bool = True) -> Array:
  """Group-normalised advantages ``(r - mean_K r) / (std_K r + eps)``, [P, K].

  Uses the population std (ddof=0) so a group of one sample gets advantage 0
  rather than NaN; a group with identical rewards also gets 0.
  """
  eps = non_negative("eps", eps)
  if jnp.ndim(rewards) != 2:
    raise ValueError(f"rewards must be [P, K], got shape {jnp.shape(rewards)}")
  r_PxK = jax.lax.stop_gradient(f32(rewards))
  adv_PxK = r_PxK - jnp.mean(r_PxK, axis=-1, keepdims=True)
  if not normalize_std:
    return adv_PxK
  denom_Px1 = jnp.std(r_PxK, axis=-1, keepdims=True) + eps
  # eps=0 with a constant group would be 0/0.
  return adv_PxK / jnp.where(denom_Px1 > 0, denom_Px1, 1.0)
