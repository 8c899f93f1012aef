"""The jitted, sharded train step shared by SFT, RL and MOPD: its batch, its loss settings,
gradient accumulation and length groups, and the `Trainer` that compiles it (the optimizer and
the train state: mopd_jax/training/optim.py, re-exported here).

The state holds only what is trained: student params, optimizer state and the step. The
teachers' log-probs arrive in the batch, or their params are an argument of the `vocab_kl`
update, gradient stopped: never in the optimizer state, the gradient or the checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mopd_jax import models
from mopd_jax.models import logprobs
from mopd_jax.runtime import distributed, sharding
from mopd_jax.training import length_groups as grouping
from mopd_jax.training.optim import (OptimConfig, TrainState, init_state, make_optimizer,
                                     state_shardings)
from mopd_jax.training.registry import loss_from_stats, LOSS_KINDS



@flax.struct.dataclass
class TrainBatch:
  """One rollout batch as the train step sees it; every per-token array is [B, T]."""

  tokens: jax.Array  # int32
  input_mask: jax.Array  # bool: real tokens (prompt, generated, observations)
  loss_mask: jax.Array  # bool: tokens the policy generated
  sampler_logprobs: Optional[jax.Array] = None  # f32, behaviour policy (PG ratio)
  teacher_logprobs: Optional[jax.Array] = None  # f32, routed teacher (MOPD)
  advantages: Optional[jax.Array] = None  # f32 [B, T] extra per-token advantage (alpha * outcome)
  teacher_topk_logprobs: Optional[jax.Array] = None  # f32 [B, T, k] (top-k variant)
  teacher_topk_ids: Optional[jax.Array] = None  # int32 [B, T, k]
  rewards: Optional[jax.Array] = None  # f32 [B] sequence rewards, rows prompt-major (RL)

  @classmethod
  def from_padded(cls, arr: dict, *, sampler_logprobs: bool = False, **fields) -> "TrainBatch":
    """The batch of a `rollout.pad_batch` result (the one padded layout every loop uses):
    its tokens and masks, its sampler log-probs when `sampler_logprobs`, and any other
    field given (arrays or None)."""
    kw = {k: _to_device(arr[k]) for k in ("tokens", "input_mask", "loss_mask")}
    if sampler_logprobs:
      kw["sampler_logprobs"] = _to_device(arr["sampler_logprobs"])
    kw.update({k: None if v is None else _to_device(v) for k, v in fields.items()})
    return cls(**kw)


def _to_device(x):
  """A host array as a JAX array, by transfer: `jnp.asarray` of a NumPy array compiles a
  copy program for every new shape (the toy's loops meet hundreds of batch shapes); a JAX
  array passes unchanged."""
  return x if isinstance(x, jax.Array) else jax.device_put(np.asarray(x))


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """What the train step needs of its loss: the loss (`kind`) and its own hyperparameters
  (`args`, an instance of its `LossKind.args`), and what every loss of a stage shares: eq.
  15's per-token reward clip (the MOPD stage's reward, which its losses optimise or report),
  the RL phase's log-ratio weight (set by the stage's schedule), the chunking, the group
  size and the importance-weight bounds of a stale or partial batch."""
  kind: str = "mopd"  # a name of LOSS_KINDS
  r_max: float = 5.0  # MOPD reward clip
  chunk_size: int = 64  # sequence chunk of the log-prob scan
  # Token-separable kinds backpropagate through the head inside each chunk (`logprobs.
  # fused_token_loss`): the scan's loss and gradient with one vocabulary projection fewer.
  fused_head: bool = True
  group_size: int = 1  # RL: K samples per prompt (rows [p*K:(p+1)*K] share a prompt)
  tau_kl: float = 0.5  # RL phase: weight of the log-ratio to the sampling policy (PMD)
  # MOPD on a stale batch (asynchronous teacher scoring): truncated importance weights
  # clip(pi_theta / pi_sampler, low, high) on each token; None = on-policy, no weights.
  is_bounds: Optional[tuple] = None
  # The loss's own hyperparameters: an instance of its `LossKind.args` (a frozen dataclass,
  # so hashable: the loss config is a static argument of the jitted step); None = the
  # dataclass's defaults (None for a loss without args).
  args: Optional[object] = None

  def __post_init__(self):
    if self.kind not in LOSS_KINDS:
      raise ValueError(f"unknown loss kind {self.kind!r}; known: {tuple(LOSS_KINDS)}")
    want = LOSS_KINDS[self.kind].args
    if self.args is None and want is not None:
      try:
        object.__setattr__(self, "args", want())
      except TypeError as e:
        raise ValueError(f"loss {self.kind!r} needs its args ({want.__name__}): {e}") from e
    if (self.args is None) != (want is None) or (want is not None and
                                                 not isinstance(self.args, want)):
      raise ValueError(f"loss {self.kind!r} takes args of type {want}, got {self.args!r}")
    if not self.r_max > 0:
      raise ValueError(f"r_max must be > 0, got {self.r_max}")


def compute_loss(model_cfg: models.ModelConfig, loss_cfg: LossConfig, params,
                 *, batch: TrainBatch):
  """(loss, metrics) of the configured kind, from the student's chunked log-probs."""
  model_cfg, params = models.materialize(model_cfg, params)  # QAT: quantise once
  kind = LOSS_KINDS[loss_cfg.kind]
  if loss_cfg.fused_head and kind.separable:
    h = models.hidden_states(model_cfg, params, batch.tokens, input_mask=batch.input_mask)
    return logprobs.fused_token_loss(
        model_cfg, params, h, tokens_BxT=batch.tokens,
        loss_fn=lambda lp, b: loss_from_stats(loss_cfg, logprobs.TokenStats(lp), b), aux=batch,
        chunk_size=loss_cfg.chunk_size)
  topk = kind.topk
  st = logprobs.token_stats(model_cfg, params, batch.tokens, input_mask=batch.input_mask,
                            chunk_size=loss_cfg.chunk_size,
                            top_k=batch.teacher_topk_ids.shape[-1] if topk else 0,
                            topk_ids_BxTxK=batch.teacher_topk_ids if topk else None)
  return loss_from_stats(loss_cfg, st, batch)


def with_reference_logprobs(model_cfg: models.ModelConfig, loss_cfg: LossConfig, reference,
                            *, batch: TrainBatch) -> TrainBatch:
  """`batch` with `sampler_logprobs` replaced by the teacher-forced log-probs of the
  `reference` params (gradient-stopped): the old policy of PMD's log-ratio when it is held
  fixed for a whole phase instead of being the policy that sampled (one update old)."""
  st = logprobs.token_stats(model_cfg, reference, batch.tokens, input_mask=batch.input_mask,
                            chunk_size=loss_cfg.chunk_size)
  return batch.replace(sampler_logprobs=jax.lax.stop_gradient(st.logprobs))


# How `accumulate_gradients` combines the microbatches' metrics into the whole batch's.
# Every metric the losses report is one of: a count (summed), a maximum, a mean over PMD's
# equal-sized groups (equal weights), or a mean over the batch's loss-mask tokens (weighted
# by each microbatch's share of those tokens) -- the default. Each rule reproduces the
# whole-batch value exactly, so no metric is an average of microbatch averages.
_SUMMED_METRICS = ("num_tokens", "num_rows")
_MAX_METRICS = ("log_ratio_abs_max",)


def split_microbatches(batch: TrainBatch, microbatches: int, group_size: int = 1) -> TrainBatch:
  """Every [B, ...] leaf as [microbatches, B / microbatches, ...].

  Microbatch j holds the groups of `group_size` rows numbered j, M + j, 2M + j, ... (rows
  j, M + j, ... when group_size is 1): strided rather than contiguous so that a device's
  contiguous block of rows (the batch is sharded over rows) splits into its share of every
  microbatch locally, with no rows moving between devices, whenever it holds a multiple of
  microbatches * group_size rows. Row order does not matter to the losses, groups are kept
  whole. Raises ValueError when the rows do not divide so.
  """
  b = batch.tokens.shape[0]
  if b % microbatches:
    raise ValueError(f"the batch of {b} rows is not divisible into microbatches="
                     f"{microbatches} equal microbatches")
  rows = b // microbatches
  if rows % group_size:
    raise ValueError(f"microbatches={microbatches} split the batch of {b} rows into "
                     f"microbatches of {rows} rows, which is not a whole number of groups of "
                     f"group_size={group_size}; the group losses need whole groups")

  def split(x):
    x = x.reshape(rows // group_size, microbatches, group_size, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(microbatches, rows, *x.shape[3:])

  return jax.tree.map(split, batch)


def accumulate_gradients(model_cfg: models.ModelConfig, loss_cfg: LossConfig, params,
                         *, batch: TrainBatch, microbatches: int, grad_shardings=None,
                         mesh: Optional[Mesh] = None):
  """((loss, metrics), grads) of the whole batch, computed one microbatch at a time.

  The losses are not sums over rows but normalised means, so microbatch m enters with a
  weight w_m and the result is sum_m w_m * (loss_m, grad_m), exactly the whole-batch value:

  * sft (a mean over all loss-mask tokens): w_m = T_m / T, tokens in microbatch m over the
    batch's.
  * row-normalised losses (mopd, pg, grpo, topk; see `losses.row_normalised_mean`:
    the mean over rows holding >= 1 loss-mask token of each row's token mean):
    w_m = N_m / N, N_m = such rows in microbatch m, N = in the batch (w_m = 0 when N = 0,
    where every loss is 0). The outcome term of mopd / topk is row-normalised the same way.
  * pmd (a mean over the P prompt groups, each microbatch holding P / M whole groups):
    w_m = 1 / M.

  Gradients accumulate in float32 (a bf16 running sum would round every addition) and are
  cast back to each param's dtype, the dtype of the single-batch gradient. Metrics combine
  by the rules listed with `_SUMMED_METRICS`, each exact.

  Layouts: with `mesh`, each microbatch's rows are constrained to the batch axes, and
  `grad_shardings` (the params' shardings) constrains the float32 accumulator. In the 8B
  memory plan sharding propagation already chose exactly these (the constraints change no
  byte there); they are stated so that a replicated accumulator (a full float32 copy of the
  params per device) or replicated microbatch rows cannot follow from propagation through
  the split and the scan picking differently.
  """
  kind = LOSS_KINDS[loss_cfg.kind]
  mbs = split_microbatches(batch, microbatches, loss_cfg.group_size if kind.groups else 1)
  rows_sharded = (mesh is not None and
                  (batch.tokens.shape[0] // microbatches) %
                  math.prod(mesh.shape.get(a, 1) for a in sharding.BATCH_AXES) == 0)

  def pin_rows(tree, leading=()):
    if not rows_sharded:
      return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x, sharding.batch_sharding(mesh, x.ndim, leading)), tree)

  mbs = pin_rows(mbs, (None,))
  mask = mbs.loss_mask.astype(bool)  # [M, B/M, T]
  w_m, token_w_m = slice_weights(
      kind, jnp.sum(jnp.any(mask, axis=-1), axis=-1, dtype=jnp.float32),
      jnp.sum(mask, axis=(1, 2), dtype=jnp.float32))

  constrain = lambda tree: (tree if grad_shardings is None else
                            jax.lax.with_sharding_constraint(tree, grad_shardings))

  def body(acc, xs):
    mb, w = xs
    mb = pin_rows(mb)
    (loss, metrics), g = jax.value_and_grad(
        lambda p: compute_loss(model_cfg, loss_cfg, p, batch=mb), has_aux=True)(params)
    acc = constrain(jax.tree.map(lambda a, gi: a + w * gi.astype(jnp.float32), acc, g))
    return acc, (loss, metrics)

  acc = constrain(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
  acc, (loss_m, metrics_m) = jax.lax.scan(body, acc, (mbs, w_m))
  grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
  return (jnp.sum(w_m * loss_m), combine_metrics(kind, metrics_m, token_w_m)), grads


def slice_weights(kind, rows_m, tokens_m) -> tuple:
  """(w_m, token_w_m) of a batch's slices (microbatches or length groups) from each one's
  count of rows holding a loss-mask token (`rows_m`) and of loss-mask tokens (`tokens_m`):
  its weight in the whole-batch loss (see `accumulate_gradients`) and its share of the
  loss-mask tokens (the metrics' weight)."""
  rows_m = jnp.asarray(rows_m, jnp.float32)
  tokens_m = jnp.asarray(tokens_m, jnp.float32)
  token_w_m = tokens_m / jnp.maximum(jnp.sum(tokens_m), 1.0)
  if kind.weighting == "groups":
    w_m = jnp.full(rows_m.shape, 1.0 / rows_m.shape[0], jnp.float32)
  elif kind.weighting == "tokens":
    w_m = token_w_m
  else:
    w_m = rows_m / jnp.maximum(jnp.sum(rows_m), 1.0)
  return w_m, token_w_m


def combine_metrics(kind, metrics_m: dict, token_w_m) -> dict:
  """The whole batch's metrics from its slices' ([M] arrays), by the rules listed with
  `_SUMMED_METRICS`, each exact."""
  metrics = {}
  for name, v in metrics_m.items():
    if name in _SUMMED_METRICS:
      metrics[name] = jnp.sum(v)
    elif name in _MAX_METRICS:
      metrics[name] = jnp.max(v)
    elif name in kind.group_mean_metrics:
      metrics[name] = jnp.mean(v)
    else:
      metrics[name] = jnp.sum(token_w_m * v)
  return metrics


def loss_and_grads(model_cfg: models.ModelConfig, loss_cfg: LossConfig, params,
                   *, batch: TrainBatch, microbatches: int = 1, grad_shardings=None,
                   mesh: Optional[Mesh] = None):
  """((loss, metrics), grads) of `batch`: in one pass, or accumulated over `microbatches`
  slices (`accumulate_gradients`), with the same result and less activation memory."""
  if microbatches == 1:
    return jax.value_and_grad(
        lambda p: compute_loss(model_cfg, loss_cfg, p, batch=batch), has_aux=True)(params)
  return accumulate_gradients(model_cfg, loss_cfg, params, batch=batch,
                              microbatches=microbatches, grad_shardings=grad_shardings,
                              mesh=mesh)


def apply_gradients(optimizer: optax.GradientTransformation, *, state: TrainState, loss,
                    metrics: dict, grads):
  """The optimizer update of `grads`; with a non-finite loss or gradient it is not applied
  (the caller decides to stop or skip). Returns (state, metrics with loss, grad norm and
  finite)."""
  gnorm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  new_state = TrainState(step=state.step + finite.astype(jnp.int32),
                         params=keep(params, state.params),
                         opt_state=keep(opt_state, state.opt_state))
  return new_state, {**metrics, "loss": loss, "grad_norm": gnorm,
                     "finite": finite.astype(jnp.float32)}


def train_step(model_cfg: models.ModelConfig, loss_cfg: LossConfig,
               optimizer: optax.GradientTransformation, *, state: TrainState, batch: TrainBatch,
               microbatches: int = 1, grad_shardings=None, mesh: Optional[Mesh] = None):
  """One optimizer update. Non-finite loss or gradient: the update is not applied.

  `microbatches` > 1: the gradient is accumulated over that many slices of the batch
  (`accumulate_gradients`), with the same result as 1 and less activation memory.
  """
  (loss, metrics), grads = loss_and_grads(model_cfg, loss_cfg, state.params, batch=batch,
                                          microbatches=microbatches,
                                          grad_shardings=grad_shardings, mesh=mesh)
  return apply_gradients(optimizer, state=state, loss=loss, metrics=metrics, grads=grads)


def batch_shardings(mesh: Mesh, batch: TrainBatch) -> TrainBatch:
  return jax.tree.map(lambda x: sharding.batch_sharding(mesh, x.ndim), batch)


class Trainer:
  """Jitted init and step with explicit shardings, for one (model, loss, optimizer) triple."""

  def __init__(self, model_cfg: models.ModelConfig, loss_cfg: LossConfig,
               optim_cfg: OptimConfig, *, mesh: Mesh, rules=sharding.DEFAULT_RULES):
    self.model_cfg, self.loss_cfg, self.mesh = model_cfg, loss_cfg, mesh
    self.microbatches = optim_cfg.microbatches
    self.length_groups = optim_cfg.length_groups
    self.group_width_multiple = optim_cfg.group_width_multiple
    self.optimizer = make_optimizer(optim_cfg)
    self.state_sharding = state_shardings(model_cfg, self.optimizer, mesh, rules=rules)
    rep = NamedSharding(mesh, P())
    self._init = jax.jit(lambda params: init_state(params, self.optimizer),
                         in_shardings=(self.state_sharding.params,),
                         out_shardings=self.state_sharding)
    self._step_cache = {}
    self._rep = rep

  def init(self, params) -> TrainState:
    """A train state from student params (placed onto the mesh as needed)."""
    return self._init(params)

  def abstract_state(self, params_like) -> TrainState:
    """Shapes, dtypes and shardings of `init(params)` without computing it: the target a
    checkpoint is restored onto (on this mesh, whatever mesh wrote it)."""
    shapes = jax.eval_shape(self._init, params_like)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_sharding)

  def jitted_step(self, batch: TrainBatch, with_reference: bool = False):
    """The jitted step for batches of this structure (arrays or ShapeDtypeStructs): what
    `step` runs, and what `benchmarks.memory_plan` lowers without running. With
    `with_reference` it takes reference params as a third argument (see `step`)."""
    key = (jax.tree.structure(batch), with_reference)
    if key not in self._step_cache:
      def fn(s, b, *ref):
        if ref:
          b = with_reference_logprobs(self.model_cfg, self.loss_cfg, ref[0], batch=b)
        return train_step(self.model_cfg, self.loss_cfg, self.optimizer, state=s, batch=b,
                          microbatches=self.microbatches,
                          grad_shardings=self.state_sharding.params, mesh=self.mesh)
      # State in and out with the same shardings, donated: the update happens in place and
      # the old params/moments never coexist with the new ones in memory.
      self._step_cache[key] = jax.jit(
          fn, in_shardings=(self.state_sharding, batch_shardings(self.mesh, batch)) +
          ((self.state_sharding.params,) if with_reference else ()),
          out_shardings=(self.state_sharding, self._rep),
          donate_argnums=(0,))
    return self._step_cache[key]

  def step(self, state: TrainState, batch: TrainBatch, reference=None):
    """One update. `reference`: params whose teacher-forced log-probs replace the batch's
    `sampler_logprobs` as the loss's old policy (PMD held to a fixed reference). With
    `OptimConfig.length_groups` > 1 (one process) the rows go through `grouped_step`."""
    sharding.check_batch_divisible(batch.tokens.shape[0], self.mesh)
    if self.length_groups > 1 and jax.process_count() == 1:
      kind = LOSS_KINDS[self.loss_cfg.kind]
      unit = self.loss_cfg.group_size if kind.groups else 1
      groups = grouping.split(batch, self.length_groups, unit=unit,
                             multiple=self.group_width_multiple,
                             row_divisor=math.lcm(sharding.batch_devices(self.mesh),
                                                  self.microbatches * unit))
      if groups is not None:
        return self.grouped_step(state, groups, reference)
    if jax.process_count() > 1:  # host batch -> global arrays, each process its own rows
      batch = distributed.to_global(batch, batch_shardings(self.mesh, batch))
    if reference is None:
      return self.jitted_step(batch)(state, batch)
    return self.jitted_step(batch, with_reference=True)(state, batch, reference)

  def grouped_step(self, state: TrainState, groups, reference=None):
    """One update from a batch's length groups (`length_groups.split`): each group's
    gradient by its own program (one compilation per group shape), added into a float32
    accumulator with the group's weight in the whole-batch loss (`slice_weights`), then one
    optimizer update (`apply_gradients`) and the whole batch's metrics (`combine_metrics`)."""
    kind = LOSS_KINDS[self.loss_cfg.kind]
    masks = [jax.device_get(g.loss_mask).astype(bool) for g in groups]
    w_m, token_w_m = slice_weights(kind, [m.any(-1).sum() for m in masks],
                                   [m.sum() for m in masks])
    acc, parts = self._jit("zeros")(state.params), []
    for g, w in zip(groups, jax.device_get(w_m)):
      acc, part = self._group_grad(g, reference is not None)(state.params, acc,
                                                             (g, w, reference))
      parts.append(part)
    return self._jit("apply")(state, acc, (tuple(parts), w_m, token_w_m))

  def _group_grad(self, batch: TrainBatch, with_reference: bool):
    """The jitted (params, acc, (group, w, reference)) -> (acc + w * grad, (loss, metrics))."""
    key = ("group", jax.tree.structure(batch), with_reference)
    if key not in self._step_cache:
      def fn(params, acc, inputs):
        b, w, ref = inputs
        if ref is not None:
          b = with_reference_logprobs(self.model_cfg, self.loss_cfg, ref, batch=b)
        part, g = loss_and_grads(self.model_cfg, self.loss_cfg, params, batch=b,
                                 microbatches=self.microbatches,
                                 grad_shardings=self.state_sharding.params, mesh=self.mesh)
        return jax.tree.map(lambda a, gi: a + w * gi.astype(jnp.float32), acc, g), part
      p_sh = self.state_sharding.params
      inputs = (batch_shardings(self.mesh, batch), self._rep, p_sh if with_reference else None)
      self._step_cache[key] = jax.jit(fn, in_shardings=(p_sh, p_sh, inputs),
                                      out_shardings=(p_sh, self._rep), donate_argnums=(1,))
    return self._step_cache[key]

  def _jit(self, name: str):
    """The grouped step's other programs: "zeros" (params -> a float32 zero accumulator)
    and "apply" (state, acc, (parts, w_m, token_w_m) -> the update and its metrics)."""
    if name not in self._step_cache:
      kind, p_sh = LOSS_KINDS[self.loss_cfg.kind], self.state_sharding.params

      def apply(s, acc, inputs):
        parts, w_m, token_w_m = inputs
        grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, s.params)
        stacked = {k: jnp.stack([m[k] for _, m in parts]) for k in parts[0][1]}
        return apply_gradients(self.optimizer, state=s,
                               loss=jnp.sum(w_m * jnp.stack([l for l, _ in parts])),
                               metrics=combine_metrics(kind, stacked, token_w_m), grads=grads)
      self._step_cache[name] = (
          jax.jit(lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p),
                  in_shardings=(p_sh,), out_shardings=p_sh) if name == "zeros" else
          jax.jit(apply, in_shardings=(self.state_sharding, p_sh, self._rep),
                  out_shardings=(self.state_sharding, self._rep), donate_argnums=(0,)))
    return self._step_cache[name]
