"""The optimizer and the train state: AdamW with warmup and cosine decay behind a global-norm
clip (`make_optimizer`), the state that holds only what is trained (params, optimizer state,
step) and its shardings, the optimizer's moments following their params.
"""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mopd_jax import models
from mopd_jax.runtime import sharding


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 1e-3
  warmup_steps: int = 10
  total_steps: int = 1000
  end_lr_frac: float = 0.1  # cosine decays to lr * end_lr_frac
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  # Gradient accumulation: the step's rows are split into this many equal microbatches
  # whose gradients are summed (`lax.scan`, one microbatch's activations live at a time)
  # before the one optimizer update. Exact: the same loss, metrics and gradient as the whole
  # batch at once (see `accumulate_gradients` for the weighting), at 1/microbatches of the
  # activation memory. The batch rows must divide evenly; group losses (pmd, grpo) need
  # whole groups of `LossConfig.group_size` rows in every microbatch.
  microbatches: int = 1
  # Length groups: the step's rows sorted by their length and split into this many equal
  # groups (whole groups of `LossConfig.group_size` rows for the group losses), each cut to
  # the width its longest row needs (a multiple of `group_width_multiple`), one gradient
  # program per group shape, the groups' gradients summed with `accumulate_gradients`'s
  # weights before the one optimizer update (`length_groups`, `Trainer.step`). The same
  # loss, metrics and gradient as the whole batch up to float reassociation, at the cost of
  # the tokens the groups hold instead of B x T: a batch that mixes 3-token answers with
  # 150-token traces pads far less. 1 = the whole batch in one program.
  length_groups: int = 1
  group_width_multiple: int = 32

  def __post_init__(self):
    for name in ("microbatches", "length_groups", "group_width_multiple"):
      m = getattr(self, name)
      if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"OptimConfig.{name} must be a positive int, got {m!r}")


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.end_lr_frac)
  return optax.chain(
      optax.clip_by_global_norm(cfg.clip_norm),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def init_state(params, optimizer) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def state_shardings(model_cfg: models.ModelConfig, optimizer, mesh: Mesh,
                    *, rules=sharding.DEFAULT_RULES) -> TrainState:
  """Shardings of the whole train state: optimizer moments follow their params."""
  p_sh = sharding.param_shardings(model_cfg, mesh, rules)
  abstract = jax.eval_shape(
      lambda: init_state(models.init_params(model_cfg, jax.random.PRNGKey(0)), optimizer))
  rep = NamedSharding(mesh, P())
  # Moment trees mirror the params and take their shardings; scalars (counts) replicate.
  opt_sh = _replace_param_like(abstract.opt_state, jax.tree.map(lambda _: rep,
                                                                abstract.opt_state),
                               jax.tree.structure(abstract.params), p_sh=p_sh)
  return TrainState(step=rep, params=p_sh, opt_state=opt_sh)


def _replace_param_like(tree, shard_tree, p_struct, *, p_sh):
  """Walk the optimizer state; wherever a subtree has the params' structure, use p_sh."""
  if jax.tree.structure(tree) == p_struct:
    return p_sh
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # NamedTuple states
    return type(tree)(*(_replace_param_like(t, s, p_struct, p_sh=p_sh)
                        for t, s in zip(tree, shard_tree)))
  if isinstance(tree, (tuple, list)):
    return type(tree)(_replace_param_like(t, s, p_struct, p_sh=p_sh)
                      for t, s in zip(tree, shard_tree))
  return shard_tree
