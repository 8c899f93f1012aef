"""Domain RL with an annealed length budget: one lane per domain, three frozen teachers each.

A lane starts from pi_SFT and runs the efforts in order max -> high -> low, each continuing
from the previous one. A trajectory scores -1 once it exceeds `tau_e * b0(x)` tokens
(decoding is cut there), else the verifier's reward. The default optimiser is the Kimi
K1.5/K2 policy-mirror-descent squared loss over K samples per prompt; GRPO with the clipped
ratio loss is an option (`rl.loss`). After each effort the lane freezes teacher (d, e):
params to `<lane_dir>/teacher_<e>` (orbax) and a manifest entry with its eval metrics.

Lanes share nothing: each has its own directory, iterator, rng stream and optimizer, so they
can run one after another in one process or side by side as separate processes.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import checkpoint, models, rollout, sft, train
from mopd_jax.tasks import base as task_base

EFFORT_ORDER = ("max", "high", "low")


def rl_batch(tok, trajs, rewards, width: int) -> train.TrainBatch:
  arr = rollout.pad_batch(trajs, tok.pad_id, width)
  return train.TrainBatch(tokens=jnp.asarray(arr["tokens"]),
                          input_mask=jnp.asarray(arr["input_mask"]),
                          loss_mask=jnp.asarray(arr["loss_mask"]),
                          sampler_logprobs=jnp.asarray(arr["sampler_logprobs"]),
                          rewards=jnp.asarray(rewards, jnp.float32))


def rewards_of(task, examples, result: rollout.RolloutResult) -> np.ndarray:
  """Verifier score, or -1 for a trajectory cut at its budget."""
  return np.asarray([-1.0 if over else task.verify(ex, text)
                     for ex, text, over in zip(examples, result.texts, result.over_budget)],
                    np.float32)


def run_effort(trainer: train.Trainer, state: train.TrainState, engine: rollout.RolloutEngine,
               task, next_examples: Callable[[int], list], *, effort: str, tau: float,
               steps: int, group_size: int, width: int, seed: int,
               log: Optional[Callable] = None, start_step: int = 0, loop=None,
               reference=None):
  """`steps` RL iterations at one effort level; returns the new state and per-step metrics.

  `reference`: params held as PMD's old policy for the whole phase (`rl.reference =
  "phase"`: the effort's parent teacher), instead of the policy that sampled each batch.

  `loop`: a `checkpoint.TrainLoop` (per-step checkpoints, SIGTERM, non-finite policy); the
  run then starts at `loop.start_step` and the returned history includes restored steps.
  """
  history = []
  if loop is not None:
    start_step, history = loop.start_step, loop.history
  for step in range(start_step, steps):
    exs = next_examples(step)
    rows = [ex for ex in exs for _ in range(group_size)]
    budgets = [task_base.budget(ex, tau) for ex in rows]
    # A pure function of (seed, effort, step): a resumed lane draws the same samples.
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed),
                                                EFFORT_ORDER.index(effort)), step)
    res = engine.run(state.params, rows, [effort] * len(rows), budgets, rng,
                     environment=task.environment)
    rewards = rewards_of(task, rows, res)
    longest = max(len(t.prompt_ids) + t.num_tokens for t in res.trajectories)
    w = max(width, -(-longest // 32) * 32)  # few distinct widths: few compilations
    state, m = trainer.step(state, rl_batch(engine.tok, res.trajectories, rewards, w),
                            reference=reference)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    m.update(reward=float(rewards.mean()), accuracy=float((rewards > 0).mean()),
             over_budget=float(res.over_budget.mean()), length=float(res.lengths.mean()))
    if loop is not None:
      loop.end_step(step, state, m, [step, m])  # appends to `history`
    elif not m["finite"]:
      raise FloatingPointError(f"RL {task.name}/{effort} step {step}: non-finite loss "
                               f"{m['loss']} or grad norm {m['grad_norm']}")
    else:
      history.append((step, m))
    if log is not None:
      log(step, m)
  return state, history
