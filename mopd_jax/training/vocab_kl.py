"""The exact per-token KL(student || routed teacher) over the whole vocabulary, along the
student's own rollouts, with every routed teacher in one program: the MOPD stage's exact-KL
diagnostic, the eval's held-out KL, and the `vocab_kl` loss.

The `vocab_kl` loss is K3 eq. 15's per-token gradient with its expectation over the sampled
token taken exactly. At a position with prefix s, eq. 15's gradient is
r(y) grad log pi(y | s) with y ~ pi(. | s) and r(y) = log pi_T(y | s) - log pi(y | s) (before
the clip); its expectation over y is sum_y pi(y | s) (log pi(y | s) - log pi_T(y | s))
grad log pi(y | s) = grad KL(pi(. | s) || pi_T(. | s)) (the term sum_y grad pi(y | s) is 0).
So minimising the per-position KL over the visited prefixes, each row's mean over its
generated tokens (eq. 15's 1/|y|), follows eq. 15's expected update without its sampling
noise, which dominates once the student is near its teachers (docs/choices.md). The
prefixes are still the student's own samples: the distillation stays on-policy. Eq. 15
clips r at r_max; the KL's gradient does not, and `vocab_kl.clip=True` takes the clipped
expectation, sum_y pi(y | s) clip(r(y)) grad log pi(y | s), instead (the loss's value stays
the KL; measured in docs/toy_results.md: it does not lower the held-out KL).

Layout: the student's hidden states of its [B, T] batch are gathered into the teachers'
stratified [K, b, T'] layout (row `rows[k, i]`, positions shifted by `shift[k, i]`, the
teacher's prompt being the student's without the effort) and meet teacher k's own hidden
states there; the vocabulary projections run in chunks (`logprobs.kl_from_hidden`), so
[B, T, V] logits never exist. The teachers' params are an argument of the program, with the
gradient stopped: they never enter the optimizer state or the student checkpoint.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import models
from mopd_jax.models import logprobs
from mopd_jax.runtime import distributed
from mopd_jax.teachers import bank as teachers
from mopd_jax.training import losses, step as train


class Stratified(NamedTuple):
  """One batch's arrays for the stratified KL: the student's tokens and input mask [B, T],
  the teachers' tokens and input mask [K, b, T'], each stratified row's shift from the
  teacher's positions to the student's and its row of the student's batch [K, b] (-1: an
  empty slot)."""
  tokens: jax.Array
  input_mask: jax.Array
  teacher_tokens: jax.Array
  teacher_mask: jax.Array
  shift: jax.Array
  rows: jax.Array


def stratified(sampled, *, like) -> Stratified:
  """The host arrays of a `mopd.SampledBatch` as `stratified_kl` takes them: on the devices,
  or, when several processes hold the batch, global arrays replicated over the mesh of the
  params `like`."""
  index = sampled.index
  if sampled.spans is None:
    shift_rows = np.zeros(sampled.arr["tokens"].shape[0], np.int32)
  else:
    shift_rows = np.asarray([ps - pt for ps, pt, _ in sampled.spans], np.int32)
  shift = np.where(index >= 0, shift_rows[np.maximum(index, 0)], 0).astype(np.int32)
  host = Stratified(np.asarray(sampled.arr["tokens"]), np.asarray(sampled.arr["input_mask"]),
                    np.asarray(sampled.tokens), np.asarray(sampled.input_mask), shift,
                    np.asarray(index, np.int32))
  if jax.process_count() > 1:  # every process holds the batch: global, replicated arrays
    rep = jax.sharding.NamedSharding(distributed.mesh_of(like), jax.sharding.PartitionSpec())
    return Stratified(*distributed.to_global(tuple(host), rep))
  return Stratified(*(jax.device_put(x) for x in host))


def _to_teacher_layout(x_BxT, arrays: Stratified, width: int):
  """[B, T, ...] values of the student's positions on the teachers' [K, b, T', ...] layout:
  row `rows[k, i]`, position p + shift[k, i] (clamped at the edges, where the masks are 0)."""
  x = x_BxT[jnp.maximum(arrays.rows, 0)]  # [K, b, T, ...]
  pos = jnp.arange(width)[None, None, :] + arrays.shift[..., None]
  pos = jnp.clip(pos, 0, x_BxT.shape[1] - 1)
  pos = pos.reshape(pos.shape + (1,) * (x.ndim - 3))
  return jnp.take_along_axis(x, pos, axis=2)


def _per_teacher(student_cfg: models.ModelConfig, student_params,
                 teacher_cfg: models.ModelConfig, *, teacher_params_K, arrays: Stratified, fn):
  """(fn's [K, ...] outputs, (the student's materialised config, params, [B, T, D] hidden
  states)): `fn((student cfg, params), (teacher k's cfg, params), (the student's hidden
  states on teacher k's rows [b, T', D], teacher k's own [b, T', D]))` for every teacher k
  of the stratified layout, in one vmap; the teachers' gradient is stopped."""
  s_cfg, s_params = models.materialize(student_cfg, student_params)
  h = models.hidden_states(s_cfg, s_params, arrays.tokens, input_mask=arrays.input_mask)
  hs = _to_teacher_layout(h, arrays, arrays.teacher_tokens.shape[-1])  # [K, b, T', D]

  def one(p, rows):  # one teacher's params and its (tokens, mask, student hidden states)
    tok, m, h_s = rows
    t_cfg, p = models.materialize(teacher_cfg, p)
    h_t = models.hidden_states(t_cfg, p, tok, input_mask=m)
    return fn((s_cfg, s_params), (t_cfg, p), (h_s, h_t))

  out = jax.vmap(one)(jax.lax.stop_gradient(teacher_params_K),
                      (arrays.teacher_tokens, arrays.teacher_mask, hs))
  return out, (s_cfg, s_params, h)


def stratified_kl(student_cfg: models.ModelConfig, student_params,
                  teacher_cfg: models.ModelConfig, *, teacher_params_K, arrays: Stratified,
                  chunk_size: int = 64, with_logprobs: bool = False, r_max: float = math.inf):
  """[K, b, T'] exact KL(student || teacher k) of each next token on the teachers' layout,
  differentiable in the student's params (the teachers' gradient is stopped; a finite
  `r_max` gives it eq. 15's clipped expected gradient, `logprobs.kl_from_hidden`). With
  `with_logprobs`, (that KL, the student's log-prob of each sampled token on the same
  layout)."""
  def one(student, teacher, hiddens):
    (s_cfg, s_params), (t_cfg, p), (h_s, h_t) = student, teacher, hiddens
    return logprobs.kl_from_hidden(s_cfg, s_params, h_s, cfg_q=t_cfg, params_q=p,
                                   hidden_q_BxTxD=h_t, chunk_size=chunk_size, r_max=r_max)

  kl, (s_cfg, s_params, h) = _per_teacher(student_cfg, student_params, teacher_cfg,
                                          teacher_params_K=teacher_params_K, arrays=arrays,
                                          fn=one)
  if not with_logprobs:
    return kl
  lp = logprobs.token_stats_from_hidden(s_cfg, s_params, h, tokens_BxT=arrays.tokens,
                                        options=logprobs.StatsOptions(chunk_size=chunk_size))
  return kl, _to_teacher_layout(lp.logprobs, arrays, arrays.teacher_tokens.shape[-1])


@functools.partial(jax.jit, static_argnums=(0, 2), static_argnames=("chunk_size",))
def _kl_program(student_cfg, student_params, teacher_cfg, *, teacher_params_K, arrays,
                chunk_size):
  return stratified_kl(student_cfg, student_params, teacher_cfg,
                       teacher_params_K=teacher_params_K, arrays=arrays, chunk_size=chunk_size)


def exact_kl_rows(student_cfg: models.ModelConfig, student_params, bank: teachers.TeacherBank,
                  *, sampled, chunk_size: int = 64) -> np.ndarray:
  """[B, T] exact per-token KL(student || routed teacher) over the whole vocabulary, on the
  student's own rollouts and positions (0 off the response). `bank` scores as in the step
  (its temperature applied)."""
  kl = _kl_program(student_cfg, student_params, bank.model_cfg,
                   teacher_params_K=bank.params,
                   arrays=stratified(sampled, like=student_params),
                   chunk_size=chunk_size)
  rows = teachers.scatter_stratified(np.asarray(distributed.gather(kl)), sampled.index,
                                     sampled.arr["tokens"].shape[0])
  return sampled.student_layout(rows) * np.asarray(sampled.arr["loss_mask"], np.float32)


def kl_logit_gradients(logp, logq, *, r_max: float):
  """(g, g_clip, beyond), each [..., V], from the log-softmaxes `logp` and `logq` over the
  last axis (the vocabulary): g is the gradient of KL(p || q) in p's logits,
  p * (log p - log q - KL); g_clip the same gradient of the clipped expectation
  `logprobs.kl_from_hidden` takes with a finite r_max, p * (W - clip(r)), r = log q - log p,
  W = sum_y p(y) clip(r(y)); `beyond` marks the tokens whose r lies outside
  [-r_max, r_max], the only ones where g and g_clip differ in their own terms."""
  p = jnp.exp(logp)
  r = logq - logp
  kl = jnp.sum(p * -r, axis=-1, keepdims=True)
  rc = jnp.clip(r, -r_max, r_max)
  g = p * (-r - kl)
  g_clip = p * (jnp.sum(p * rc, axis=-1, keepdims=True) - rc)
  return g, g_clip, jnp.abs(r) > r_max


@functools.partial(jax.jit, static_argnums=(0, 2))
def _clip_share_program(student_cfg, student_params, teacher_cfg, *, teacher_params_K, arrays,
                        r_max):
  def one(student, teacher, hiddens):
    (s_cfg, s_params), (t_cfg, p), (h_s, h_t) = student, teacher, hiddens
    lp = jax.nn.log_softmax(models.logits_from_hidden(s_cfg, s_params, h_s[:, :-1]), -1)
    lq = jax.nn.log_softmax(models.logits_from_hidden(t_cfg, p, h_t[:, :-1]), -1)
    g, g_clip, beyond = kl_logit_gradients(lp, lq, r_max=r_max)
    sq = lambda x: jnp.pad(jnp.sum(x * x, -1), ((0, 0), (1, 0)))  # token t from position t-1
    return jnp.stack([sq(g), sq(jnp.where(beyond, g, 0.0)), sq(g_clip)], -1)

  return _per_teacher(student_cfg, student_params, teacher_cfg,
                      teacher_params_K=teacher_params_K, arrays=arrays, fn=one)[0]


def clip_share_rows(student_cfg: models.ModelConfig, student_params,
                    bank: teachers.TeacherBank, *, sampled, r_max: float) -> np.ndarray:
  """[B, T, 3] per generated token of the student's rollouts `sampled` (0 off the response):
  the squared norms of the logits' gradient of the exact KL to the routed teacher
  (`kl_logit_gradients`' g), of its part on the tokens beyond the clip, and of the clipped
  expectation's g_clip: how much of the `vocab_kl` update the tokens far from their
  teacher's log-prob drive, and what eq. 15's clip (`vocab_kl.clip`) removes.
  Materialises each teacher's [b, T, V] logits: a diagnostic for small vocabularies."""
  out = _clip_share_program(student_cfg, student_params, bank.model_cfg,
                            teacher_params_K=bank.params,
                            arrays=stratified(sampled, like=student_params),
                            r_max=float(r_max))
  rows = teachers.scatter_stratified(np.asarray(distributed.gather(out)), sampled.index,
                                     sampled.arr["tokens"].shape[0])
  mask = np.asarray(sampled.arr["loss_mask"], np.float32)[..., None]
  return sampled.student_layout(rows) * mask


def future_kl_term(kl_NxT, logprobs_NxT, mask_NxT, *, groups: int = 0):
  """(term, its metrics): the score-function part of the gradient of each row's summed KL,
  as a surrogate whose gradient is the mean over rows of
  (1/|y|) sum_t grad log pi(y_t | s_t) * A_t, A_t = sum_{t' > t} KL_t' - b_t. The
  per-position exact KL (`token_kl_loss`) differentiates each visited prefix's KL but not
  the choice of the token that leads to the next prefixes; this term charges a sampled token
  with the KL of what follows it, so a token after which the rollout leaves the teacher's
  track (its later KL large) is pushed down. The future KL is a constant of the gradient
  (stopped). `groups` = 0: no baseline (b_t = 0). `groups` = G > 0: the N rows are G
  consecutive groups (the teachers' layout: one cell per group) and b_t is the mean future
  KL at position t over the other rows of the row's group that reach t (leave-one-out, so
  b_t does not depend on the row's own tokens and the gradient's expectation is unchanged):
  a row whose continuation costs what its cell's usually does adds nothing."""
  m = mask_NxT.astype(jnp.float32)
  kl = jax.lax.stop_gradient(kl_NxT.astype(jnp.float32)) * m
  future = jnp.cumsum(kl[:, ::-1], axis=-1)[:, ::-1] - kl  # sum over t' > t
  adv = future
  if groups:
    g = lambda x: x.reshape((groups, -1) + x.shape[1:])
    fut_g, m_g = g(future * m), g(m)
    others = jnp.sum(m_g, axis=1, keepdims=True) - m_g
    base = (jnp.sum(fut_g, axis=1, keepdims=True) - fut_g) / jnp.maximum(others, 1.0)
    adv = future - jnp.where(others > 0, base, 0.0).reshape(future.shape)
  n = m.sum(-1)
  rows = n > 0
  per_row = (logprobs_NxT.astype(jnp.float32) * adv * m).sum(-1) / jnp.maximum(n, 1.0)
  term = jnp.where(rows, per_row, 0.0).sum() / jnp.maximum(rows.sum(), 1)
  mean_future = (future * m).sum() / jnp.maximum(m.sum(), 1.0)
  return term, {"future_kl_mean": jax.lax.stop_gradient(mean_future)}


def vocab_kl_loss(student_cfg: models.ModelConfig, student_params,
                  teacher_cfg: models.ModelConfig, *, teacher_params_K, arrays: Stratified,
                  batch: train.TrainBatch, loss_cfg: train.LossConfig):
  """(loss, metrics): the mean over rows of each row's mean exact KL(student || its routed
  teacher) over its generated tokens (eq. 15's 1/|y| and row weights), plus
  `loss_cfg.args.future_kl` x `future_kl_term` when it is not 0 (`loss_cfg.r_max` clips eq.
  15's metrics, `loss_cfg.chunk_size` chunks the vocabulary projections). Metrics:
  `kl_vocab` (the token mean of the optimised KL), and eq. 15's own `kl`, `reward_mean`,
  `clip_frac` from the batch's sampled-token log-probs, so that curves compare across
  losses."""
  future_kl, chunk_size = loss_cfg.args.future_kl, loss_cfg.chunk_size
  out = stratified_kl(student_cfg, student_params, teacher_cfg,
                      teacher_params_K=teacher_params_K, arrays=arrays,
                      chunk_size=chunk_size, with_logprobs=bool(future_kl),
                      r_max=loss_cfg.r_max if loss_cfg.args.clip else math.inf)
  kl_KxbxT, lp_KxbxT = out if future_kl else (out, None)
  width = arrays.teacher_tokens.shape[-1]
  mask = _to_teacher_layout(batch.loss_mask, arrays, width) & (arrays.rows >= 0)[..., None]
  pos = jnp.arange(width)[None, None, :] + arrays.shift[..., None]
  mask &= (pos >= 0) & (pos < batch.tokens.shape[1])
  loss, metrics = losses.token_kl_loss(kl_KxbxT.reshape((-1, width)),
                                       mask.reshape((-1, width)), per=loss_cfg.args.per)
  if future_kl:
    term, m_future = future_kl_term(
        kl_KxbxT.reshape((-1, width)), lp_KxbxT.reshape((-1, width)),
        mask.reshape((-1, width)),
        groups=kl_KxbxT.shape[0] if loss_cfg.args.future_baseline else 0)
    loss = loss + future_kl * term
    metrics = {**metrics, **m_future}
  _, m = losses.mopd_loss(batch.sampler_logprobs, batch.teacher_logprobs, batch.loss_mask,
                          r_max=loss_cfg.r_max)
  return loss, {**metrics, "kl": m["kl"], "reward_mean": m["reward_mean"],
                "clip_frac": m["clip_frac"]}


def check_config(m, *, teachers: str, endpoints) -> None:
  """What `mopd.loss='vocab_kl'` (the `MopdConfig` `m`) needs: the teachers' params beside
  the student's (co-located, no servers), one on-policy batch per update, no outcome term.
  Raises ValueError naming the field."""
  if endpoints:
    raise ValueError("mopd.loss='vocab_kl' computes each teacher's whole next-token "
                     "distribution inside the student's update; teacher servers "
                     f"(teacher.endpoints={endpoints!r}) return sampled-token log-probs only")
  need = {"placement.teachers": (teachers, "colocated"), "mopd.alpha": (m.alpha, 0.0),
          "mopd.staleness": (m.staleness, 0), "mopd.microbatches": (m.microbatches, 1),
          "mopd.length_groups": (m.length_groups, 1),
          "mopd.partial_rollout_tokens": (m.partial_rollout_tokens, 0)}
  for name, (value, want) in need.items():
    if value != want:
      raise ValueError(f"mopd.loss='vocab_kl' computes each teacher's whole next-token "
                       f"distribution inside the student's update; it needs {name}={want!r}, "
                       f"got {value!r}")


class VocabKLStep:
  """The `vocab_kl` update: the loss, its gradient and `trainer`'s optimizer in one jitted
  program whose arguments are the student's state, the batch, the teachers' stacked params
  (the scoring bank, its temperature applied) and the stratified layout."""

  def __init__(self, trainer: train.Trainer):
    self.trainer = trainer
    self._programs = {}

  @classmethod
  def of(cls, trainer: train.Trainer) -> "VocabKLStep":
    """The step of `trainer` (its optimizer, shardings and loss settings), made once and
    kept with it, so its programs compile once per run."""
    step = getattr(trainer, "_vocab_kl_step", None)
    if step is None:
      step = trainer._vocab_kl_step = cls(trainer)  # pylint: disable=protected-access
    return step

  def _program(self, teacher_cfg: models.ModelConfig):
    if teacher_cfg not in self._programs:
      tr = self.trainer

      def fn(state, batch, teachers_and_layout):
        teacher_params_K, arrays = teachers_and_layout
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: vocab_kl_loss(tr.model_cfg, p, teacher_cfg,
                                    teacher_params_K=teacher_params_K, arrays=arrays,
                                    batch=batch, loss_cfg=tr.loss_cfg),
            has_aux=True)(state.params)
        return train.apply_gradients(tr.optimizer, state=state, loss=loss, metrics=metrics,
                                     grads=grads)
      # The state keeps its shardings and is donated, as in `train.Trainer`; the teachers'
      # params keep the placement the bank gave them (None: as committed), the batch's
      # arrays are replicated like the exact-KL diagnostic's.
      self._programs[teacher_cfg] = jax.jit(
          fn, in_shardings=(tr.state_sharding, None, None),
          out_shardings=(tr.state_sharding, tr._rep), donate_argnums=(0,))  # pylint: disable=protected-access
    return self._programs[teacher_cfg]

  def step(self, state: train.TrainState, batch: train.TrainBatch, *,
           bank: teachers.TeacherBank, sampled):
    """One update on the student's rollouts `sampled` (a `mopd.SampledBatch`) whose
    train-step batch is `batch` (its sampled-token teacher log-probs feed the metrics)."""
    if not bank.params:
      raise ValueError("mopd.loss='vocab_kl' needs the teachers' params in this process "
                       "(co-located teachers)")
    return self._program(bank.model_cfg)(state, batch, (bank.params,
                                                        stratified(sampled, like=state.params)))
