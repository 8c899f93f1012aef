"""The losses the train step can optimise, registered by name (`register_loss`): each is
`fn(loss_cfg, stats, batch) -> (loss, metrics)` over the student's per-token stats, with the
properties the train step, the stages and the config's checks ask of it (`LossKind`). A
loss from outside the package registers itself the same way in its own module, which the
run names in `config.plugins` (docs/walkthrough.md). A loss's hyperparameters are its own
frozen dataclass (`args`), set in the config's `<stage>.loss_args.<loss name>` block and read
as `loss_cfg.args`; what every loss of a stage shares (eq. 15's reward clip `r_max`, the RL
phase's `tau_kl`, the chunking, the importance-weight bounds) is `train.LossConfig`'s."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from mopd_jax.models import logprobs
from mopd_jax.training import losses, rl_losses


@dataclasses.dataclass(frozen=True)
class LossKind:
  """A loss the train step can optimise, registered by name with `register_loss`.

  fn(loss_cfg, stats, batch) -> (loss, metrics): `stats` are the student's TokenStats.
  separable: token-separable in the student's log-probs (d loss / d lp[b, t] depends on
    lp[b, t] alone), so the vocabulary head can be fused into it
    (`logprobs.fused_token_loss`).
  weighting: how `accumulate_gradients` weighs a microbatch: by its share of the batch's
    loss tokens ("tokens"), of its rows holding loss tokens ("rows"), or equally over groups
    of `group_size` rows ("groups").
  groups: rows [p*K:(p+1)*K] form one group of `LossConfig.group_size` (kept whole).
  group_mean_metrics: metrics that are means over groups (combined with equal weights).
  topk: needs the teacher's top-k ids in the batch.
  char_targets: its top-k are the whole of a character-level student's vocabulary, the
    next-character distributions of teachers of another tokenizer
    (`mopd_jax/teachers/char_marginal.py`), built beside the update, not by the scorer.
  teachers_in_step: computed with the routed teachers' params inside the update (their
    whole next-token distributions), not from the student's stats and the batch: `fn` is
    never called, the MOPD stage runs `vocab_kl.VocabKLStep` instead.
  stage: the stage whose `loss` field may name it ("mopd", "rl" or "sft").
  args: a frozen dataclass of the loss's own hyperparameters (None: it has none): the
    config's `<stage>.loss_args.<name>` block builds it, checked, and the step reads it as
    `loss_cfg.args`. A `topk` loss's args carry `k`, the teacher tokens per position.
  importance_weights: takes truncated importance weights on a stale or partial batch
    (`LossConfig.is_bounds`; `mopd.staleness=1`, `mopd.partial_mode='importance'`).
  fixed_reference: an RL loss that may hold a fixed reference policy for an effort phase
    (`rl.reference`).
  needs_outcome: trains on the rollouts' outcome advantages (`mopd.alpha > 0`).
  """
  fn: Callable
  separable: bool
  weighting: str = "rows"
  groups: bool = False
  group_mean_metrics: tuple = ()
  topk: bool = False
  char_targets: bool = False
  teachers_in_step: bool = False
  stage: str = "mopd"
  args: Optional[type] = None
  importance_weights: bool = False
  fixed_reference: bool = False
  needs_outcome: bool = False

  def __post_init__(self):
    if self.stage not in STAGES:
      raise ValueError(f"LossKind.stage must be one of {STAGES}, got {self.stage!r}")
    if self.weighting not in ("tokens", "rows", "groups"):
      raise ValueError(f"LossKind.weighting must be 'tokens', 'rows' or 'groups', got "
                       f"{self.weighting!r}")
    if self.args is not None and not (dataclasses.is_dataclass(self.args) and
                                      self.args.__dataclass_params__.frozen):
      raise ValueError(f"LossKind.args must be a frozen dataclass, got {self.args!r}")
    if self.char_targets and not self.topk:
      raise ValueError("a char_targets loss reads its targets as top-k: it needs topk=True")
    if self.topk and not self.char_targets and (self.args is None or
                      "k" not in {f.name for f in dataclasses.fields(self.args)}):
      raise ValueError("a topk loss's args must have the field k (teacher tokens per position)")


STAGES = ("mopd", "rl", "sft")


LOSS_KINDS: dict = {}


def register_loss(name: str, **properties):
  """Decorator: registers `fn(loss_cfg, stats, batch) -> (loss, metrics)` as loss `name`
  with the `LossKind` properties given. A name registered twice by different functions is an
  error (a plugin cannot silently replace a loss)."""
  def deco(fn):
    if name in LOSS_KINDS and LOSS_KINDS[name].fn is not fn:
      raise ValueError(f"a loss named {name!r} is already registered")
    LOSS_KINDS[name] = LossKind(fn, **properties)
    return fn
  return deco


def names(stage: str) -> tuple:
  """The registered losses a stage's `loss` field may name, sorted."""
  return tuple(sorted(n for n, k in LOSS_KINDS.items() if k.stage == stage))


def default_args(kind_name: str):
  """Loss `kind_name`'s args at their defaults (None for a loss without args)."""
  kind = LOSS_KINDS[kind_name]
  return None if kind.args is None else kind.args()


def loss_args(kind_name: str, given, field: str):
  """The `args` dataclass of loss `kind_name` from the config block `given` (a mapping;
  absent fields take the dataclass's defaults); None for a loss without args. ValueError
  naming `field.<name>` for an unknown field, or a field given to a loss that has none."""
  kind, given = LOSS_KINDS[kind_name], dict(given or {})
  if kind.args is None:
    if given:
      raise ValueError(f"{field} sets {sorted(given)}, but loss {kind_name!r} takes no "
                       "arguments of its own")
    return None
  known = {f.name for f in dataclasses.fields(kind.args)}
  unknown = sorted(set(given) - known)
  if unknown:
    raise ValueError(f"unknown field(s) {[f'{field}.{k}' for k in unknown]}; loss "
                     f"{kind_name!r} takes {sorted(known)}")
  try:
    return kind.args(**given)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{field}: {e}") from e


def loss_from_stats(loss_cfg, st: logprobs.TokenStats, batch):
  """(loss, metrics) of the kind `loss_cfg` (a `train.LossConfig`) names, from the student's
  per-token stats and the `train.TrainBatch`."""
  return LOSS_KINDS[loss_cfg.kind].fn(loss_cfg, st, batch)


@register_loss("sft", separable=True, weighting="tokens", stage="sft")
def _sft_loss(loss_cfg, st, batch):
  del loss_cfg
  return losses.nll_loss(st.logprobs, batch.loss_mask)


@register_loss("mopd", separable=True, importance_weights=True)
def _mopd_loss(loss_cfg, st, batch):
  lp = st.logprobs
  w = None
  if loss_cfg.is_bounds is not None:
    low, high = loss_cfg.is_bounds
    w = losses.truncated_importance_weights(lp, batch.sampler_logprobs, batch.loss_mask,
                                            low=low, high=high)
  loss, m = losses.mopd_loss(lp, batch.teacher_logprobs, batch.loss_mask, r_max=loss_cfg.r_max,
                             importance_weights=w)
  if w is not None:
    m = {**m, "is_weight_mean": jax.lax.stop_gradient(
        jnp.sum(w) / jnp.maximum(jnp.sum(batch.loss_mask), 1))}
  return loss + _outcome_term(lp, batch), m


def _check_number(name: str, v, *, positive: bool) -> None:
  """ValueError unless `v` is a number > 0 (`positive`) or >= 0 (0 = off)."""
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if positive
                                                                    else v >= 0):
    raise ValueError(f"{name} must be a number {'> 0' if positive else '>= 0 (0 = off)'}, "
                     f"got {v!r}")


@dataclasses.dataclass(frozen=True)
class RatioClip:
  """The clipped-ratio policy gradient's own settings (`pg`, `grpo`): the ratio's clip
  [1 - eps_low, 1 + eps_high] (asymmetric, "clip-higher") and the log-ratio's clip."""
  eps_low: float = 0.2
  eps_high: float = 0.28
  log_ratio_clip: float = 20.0

  def __post_init__(self):
    for name in ("eps_low", "eps_high", "log_ratio_clip"):
      _check_number(name, getattr(self, name), positive=True)


@register_loss("pg", separable=True, args=RatioClip)
def _pg_loss(loss_cfg, st, batch):
  lp = st.logprobs
  adv = losses.mopd_reward(lp, batch.teacher_logprobs, batch.loss_mask, r_max=loss_cfg.r_max)
  if batch.advantages is not None:
    adv = adv + jnp.where(batch.loss_mask, batch.advantages, 0.0)
  a = loss_cfg.args
  loss, m = rl_losses.pg_loss(lp, batch.sampler_logprobs, adv, loss_mask=batch.loss_mask,
                              eps_low=a.eps_low, eps_high=a.eps_high,
                              log_ratio_clip=a.log_ratio_clip)
  _, m_kl = losses.mopd_loss(lp, batch.teacher_logprobs, batch.loss_mask, r_max=loss_cfg.r_max)
  return loss, {**m, "kl": m_kl["kl"], "reward_mean": m_kl["reward_mean"]}


def _groups(loss_cfg, batch):
  b = batch.tokens.shape[0]
  k = loss_cfg.group_size
  if b % k:
    raise ValueError(f"batch of {b} rows is not a whole number of groups of {k}")
  return b, k


@dataclasses.dataclass(frozen=True)
class PMDArgs:
  """PMD's own setting: a per-token clip of the log-ratio to the sampling policy (the K2.5
  regulariser); 0 = off. Its weight tau_kl is the RL phase's (`rl.tau_kl`, annealed by the
  stage's schedule), `LossConfig.tau_kl`."""
  token_clip: float = 0.0

  def __post_init__(self):
    _check_number("token_clip", self.token_clip, positive=False)


# PMD pools log-probs over a sequence: not token-separable.
@register_loss("pmd", separable=False, weighting="groups", groups=True, stage="rl",
               fixed_reference=True, args=PMDArgs,
               group_mean_metrics=("log_ratio_mean", "reward_mean", "advantage_abs_mean"))
def _pmd_loss(loss_cfg, st, batch):
  (b, k), t = _groups(loss_cfg, batch), batch.tokens.shape[1]
  return rl_losses.pmd_loss(st.logprobs.reshape(b // k, k, t),
                         batch.sampler_logprobs.reshape(b // k, k, t),
                         batch.rewards.reshape(b // k, k), tau_kl=loss_cfg.tau_kl,
                         loss_mask=batch.loss_mask.reshape(b // k, k, t),
                         token_clip=loss_cfg.args.token_clip or None)


@register_loss("grpo", separable=True, groups=True, stage="rl", args=RatioClip)
def _grpo_loss(loss_cfg, st, batch):
  (b, k), t = _groups(loss_cfg, batch), batch.tokens.shape[1]
  adv = rl_losses.grpo_advantages(batch.rewards.reshape(b // k, k)).reshape(b)
  a = loss_cfg.args
  return rl_losses.pg_loss(st.logprobs, batch.sampler_logprobs,
                           jnp.broadcast_to(adv[:, None], (b, t)), loss_mask=batch.loss_mask,
                           eps_low=a.eps_low, eps_high=a.eps_high,
                           log_ratio_clip=a.log_ratio_clip)


@dataclasses.dataclass(frozen=True)
class TopkArgs:
  """The top-k loss's own setting: how many of the routed teacher's most likely tokens each
  position scores (the scorer returns them)."""
  k: int = 8

  def __post_init__(self):
    if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
      raise ValueError(f"k must be an int >= 1, got {self.k!r}")


# Top-k needs more than the sampled token's stats: not fused.
@register_loss("topk", separable=False, topk=True, args=TopkArgs)
def _topk_loss(loss_cfg, st, batch):
  return _support_kl(loss_cfg, st, batch, name="topk_kl")


def _support_kl(loss_cfg, st, batch, *, name: str):
  """The reverse KL on the teacher's support (`losses.topk_kl_loss`) plus the outcome term.
  `kl` stays the sampled-token estimate every other kind reports (curves comparable across
  the ablation); the KL that is optimised is reported as `name`."""
  lp = st.logprobs
  loss, m = losses.topk_kl_loss(st.topk_logprobs, batch.teacher_topk_logprobs, batch.loss_mask)
  if batch.teacher_logprobs is not None:
    _, m_kl = losses.mopd_loss(lp, batch.teacher_logprobs, batch.loss_mask, r_max=loss_cfg.r_max)
    m = {**m, name: m["kl"], "kl": m_kl["kl"], "reward_mean": m_kl["reward_mean"]}
  return loss + _outcome_term(lp, batch), m


# The exact reverse KL over a character-level student's whole vocabulary against the
# teachers' next-character distributions when they have another tokenizer: the top-k form
# with every student token in the support, so its -p_s + p_t terms cancel (and both masses
# are 1: not reported).
@register_loss("char_kl", separable=False, topk=True, char_targets=True)
def _char_kl_loss(loss_cfg, st, batch):
  loss, m = _support_kl(loss_cfg, st, batch, name="char_kl")
  return loss, {k: v for k, v in m.items() if not k.endswith("topk_mass")}


# The teacher-SFT init's soft targets (`mopd.init_target='distribution'`): supervised on a
# teacher's own trajectories like "sft", against its top-k next-token distribution. No
# config's `loss` field names an "sft" loss; the MOPD stage's init builds it.
@register_loss("forward_kl", separable=False, topk=True, weighting="tokens", stage="sft",
               args=TopkArgs)
def _forward_kl_loss(loss_cfg, st, batch):
  del loss_cfg
  return losses.forward_topk_kl_loss(st.topk_logprobs, batch.teacher_topk_logprobs,
                                     batch.loss_mask)


# RL on the student with the tasks' verifiable rewards in MOPD's place (the ablation's RL
# row): REINFORCE on mopd.alpha x each rollout's outcome advantage, the teachers unused by
# the update (their sampled-token KL is still reported).
@register_loss("outcome", separable=True, needs_outcome=True)
def _outcome_loss(loss_cfg, st, batch):
  if batch.advantages is None:
    raise ValueError("the outcome loss needs the rollouts' outcome advantages (mopd.alpha > 0)")
  _, m = losses.mopd_loss(st.logprobs, batch.teacher_logprobs, batch.loss_mask,
                          r_max=loss_cfg.r_max)
  return _outcome_term(st.logprobs, batch), {
      k: m[k] for k in ("kl", "reward_mean", "num_tokens", "num_rows")}


@dataclasses.dataclass(frozen=True)
class VocabKLArgs:
  """The vocab_kl loss's own settings: the weight of its future-KL term (each sampled token's
  log-probability gradient times the exact KL of the rest of its rollout,
  `vocab_kl.future_kl_term`; 0 = off) and whether it subtracts each cell's leave-one-out
  mean future KL (`future_baseline`), and `clip`: the gradient is eq. 15's expectation
  with its reward clipped at `mopd.r_max` (`logprobs.kl_from_hidden`), not the KL's own;
  `per`: the KL's mean per rollout, then over rollouts (eq. 15's 1/|y|), or over every
  token of the batch (`losses.token_kl_loss`)."""
  future_kl: float = 0.0
  future_baseline: bool = False
  clip: bool = False
  per: str = "row"

  def __post_init__(self):
    if self.per not in losses.KL_REDUCTIONS:
      raise ValueError(f"vocab_kl.per must be 'row' (eq. 15's 1/|y|) or 'token', got "
                       f"{self.per!r}")
    _check_number("future_kl", self.future_kl, positive=False)
    for name in ("future_baseline", "clip"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"vocab_kl.{name} must be true or false, got "
                         f"{getattr(self, name)!r}")
    if self.future_baseline and not self.future_kl:
      raise ValueError("vocab_kl.future_baseline is the future-KL term's baseline; it needs "
                       "vocab_kl.future_kl > 0")


@register_loss("vocab_kl", separable=False, teachers_in_step=True, args=VocabKLArgs)
def _vocab_kl_loss(loss_cfg, st, batch):
  del loss_cfg, st, batch
  raise ValueError("the vocab_kl loss reads the routed teachers' whole next-token "
                   "distributions inside the update: run it with vocab_kl.VocabKLStep (the "
                   "MOPD stage does), not from the student's stats")


def _outcome_term(lp, batch):
  """alpha * A_outcome on every generated token, plain REINFORCE (ratio 1 at the current
  params); 0 when the batch carries no advantages (alpha = 0)."""
  if batch.advantages is None:
    return 0.0
  # The ratio is 1 at the current params, inside any clip: the clip's bounds do not bind.
  extra, _ = rl_losses.pg_loss(lp, jax.lax.stop_gradient(lp), batch.advantages,
                               loss_mask=batch.loss_mask, eps_low=0.2, eps_high=0.28)
  return extra
