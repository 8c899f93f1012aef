"""Partial rollouts: trajectories decoded a segment per step and carried across steps.

With `mopd.partial_rollout_tokens` (or `rl.partial_rollout_tokens`) = n > 0, a step decodes
at most n more tokens of every in-flight trajectory (the rows carried from earlier steps and
the step's new prompts, in one `RolloutEngine.run(resume=..., step_budget=n)` per domain)
with the current policy;
a trajectory enters the loss only once it is complete (finished, at its cap, or out of tool
turns; in RL, once every sample of its prompt is), and unfinished ones wait for the next
step. A long max-effort trace then no longer holds a whole step's decoding to its length:
each step decodes about n tokens per row. RL flushes the pool at the end of each effort
phase (the next phase has another budget).

Exactness: each trajectory keeps its PRNG key and a token's draw depends on (key, position)
only, so a trajectory continued over steps is the one the current policy would have drawn
segment by segment. Earlier segments were drawn by older policies; `MODES` below says how
an update treats them.

The pool is part of the checkpoint (`state()` / `restore()`, JSON): a resumed run continues
the same in-flight rows, so a resume is exact.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import models
from mopd_jax.config import choices
from mopd_jax.models import logprobs
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import distributed
from mopd_jax.tasks import base as task_base

# "recompute": the earlier segments' sampler log-probs are recomputed under the policy that
# takes the update, so the whole trajectory counts as on-policy (no importance weight). The
# MOPD loss evaluates the current student's log-probs anyway; the segments are at most a few
# updates old, and the dense per-token teacher reward already corrects what the student
# drew. "importance": the log-probs each segment was drawn with are kept; the MOPD loss then
# weighs tokens by clip(pi_now / pi_drawn, *is_bounds), the truncated importance weights of
# stale batches (`mopd.is_bounds`), and RL's PMD / clipped-ratio losses use them as the old
# policy: unbiased for small drift, at the price of variance.
MODES = choices.PARTIAL_MODES


@dataclasses.dataclass
class InFlight:
  """One trajectory of the pool with what its cell and verifier need."""
  example: task_base.Example
  effort: str
  traj: rollout.Trajectory
  born: int  # the step that drew its prompt
  budget: int = 0  # the row's cap on response tokens; 0 = the engine's max_response_tokens
  group: int = -1  # RL: rows sampled for one prompt share a group and are trained together


class RolloutPool:
  """The in-flight trajectories of a loop (oldest first)."""

  def __init__(self, segment_tokens: int):
    if not isinstance(segment_tokens, int) or segment_tokens < 1:
      raise ValueError(f"partial_rollout_tokens must be an int >= 1, got {segment_tokens!r}")
    self.segment_tokens = segment_tokens
    self.rows: list = []

  def add(self, engine: rollout.RolloutEngine, examples: Sequence[task_base.Example],
          efforts: Sequence, *, rng, step: int, budgets: Optional[Sequence[int]] = None,
          groups: Optional[Sequence[int]] = None) -> None:
    """New trajectories (nothing decoded yet) for a step's prompts; row i's key is
    fold_in(rng, i), the key `RolloutEngine.run` would give it. `efforts`: the effort each
    prompt is rendered with (None: without); `budgets`: per-row caps (default the engine's
    max_response_tokens); `groups`: per-row group ids (`take_groups`)."""
    keys = np.asarray(jax.vmap(lambda i: jax.random.fold_in(rng, i))(
        jnp.arange(len(examples))))
    for i, (ex, e) in enumerate(zip(examples, efforts)):
      traj = rollout.Trajectory(rollout.encode_prompt(engine.tok, ex, e), [], [], [],
                                key=keys[i])
      self.rows.append(InFlight(ex, e, traj, step, int(budgets[i]) if budgets else 0,
                                int(groups[i]) if groups else -1))

  @staticmethod
  def budget_of(engine: rollout.RolloutEngine, row: InFlight) -> int:
    """The row's cap on response tokens on `engine`."""
    return min(row.budget or engine.max_response_tokens, engine.max_response_tokens)

  def complete(self, engine: rollout.RolloutEngine, row: InFlight) -> bool:
    return not engine.can_continue(row.traj, self.budget_of(engine, row))

  def advance(self, engine: rollout.RolloutEngine, params, rng,
              *, environment_of: Callable[[str], object]) -> None:
    """Decode up to `segment_tokens` more tokens of every incomplete row, one engine call
    per domain (its environment answers tool calls)."""
    todo = [r for r in self.rows if not self.complete(engine, r)]
    for d in dict.fromkeys(r.example.domain for r in todo):
      rows = [r for r in todo if r.example.domain == d]
      res = engine.run(params, [r.example for r in rows], [r.effort for r in rows],
                       budgets=[self.budget_of(engine, r) for r in rows], rng=rng,
                       environment=environment_of(d), resume=[r.traj for r in rows],
                       step_budget=self.segment_tokens)
      for r, t in zip(rows, res.trajectories):
        r.traj = t

  def take(self, engine: rollout.RolloutEngine, key: Callable[[InFlight], object],
           limit: int) -> list:
    """Remove and return the complete rows, oldest first, at most `limit` per `key` (a
    cell); the rest stay for a later step."""
    out, counts, keep = [], {}, []
    for r in self.rows:
      k = key(r)
      if self.complete(engine, r) and counts.get(k, 0) < limit:
        counts[k] = counts.get(k, 0) + 1
        out.append(r)
      else:
        keep.append(r)
    self.rows = keep
    return out

  def take_groups(self, engine: rollout.RolloutEngine, limit: int) -> list:
    """Remove and return the rows of complete groups (every row of the group complete),
    oldest group first, at most `limit` groups, each group's rows in the order added."""
    groups = {}
    for r in self.rows:
      groups.setdefault(r.group, []).append(r)
    chosen = [g for g, rows in groups.items()
              if all(self.complete(engine, r) for r in rows)][:limit]
    taken = set(chosen)
    self.rows = [r for r in self.rows if r.group not in taken]
    return [r for g in chosen for r in groups[g]]

  def state(self) -> list:
    """JSON of every in-flight row (examples, trajectories, keys)."""
    return [{"example": dataclasses.asdict(r.example), "effort": r.effort, "born": r.born,
             "budget": r.budget, "group": r.group,
             "traj": {"prompt_ids": list(map(int, r.traj.prompt_ids)),
                      "ids": list(map(int, r.traj.ids)),
                      "gen_mask": list(map(int, r.traj.gen_mask)),
                      "logprobs": [float(x) for x in r.traj.logprobs],
                      "finished": bool(r.traj.finished), "turns": int(r.traj.turns),
                      "key": np.asarray(r.traj.key).tolist()}}
            for r in self.rows]

  def restore(self, rows: Optional[list]) -> None:
    self.rows = []
    for r in rows or []:
      t = dict(r["traj"])
      t["key"] = np.asarray(t["key"], np.uint32)
      t["logprobs"] = [float(np.float32(x)) for x in t["logprobs"]]
      self.rows.append(InFlight(task_base.Example(**r["example"]), r["effort"],
                                rollout.Trajectory(**t), int(r["born"]), int(r["budget"]),
                                int(r["group"])))


@functools.lru_cache(maxsize=8)
def _token_logprobs(model_cfg: models.ModelConfig):
  return jax.jit(lambda params, tokens, mask: logprobs.token_logprobs(
      model_cfg, params, tokens, input_mask=mask))


def recompute_logprobs(model_cfg: models.ModelConfig, params, arr: dict) -> dict:
  """`arr` (a `rollout.pad_batch` batch) with its sampler log-probs replaced by the log-probs
  of `params` on the same tokens (0 off the generated tokens): mode "recompute"."""
  host = (np.asarray(arr["tokens"]), np.asarray(arr["input_mask"]))
  if jax.process_count() > 1:  # every process holds the batch: global, replicated arrays
    rep = jax.sharding.NamedSharding(distributed.mesh_of(params), jax.sharding.PartitionSpec())
    host = distributed.to_global(host, rep)
  lp = np.asarray(distributed.gather(_token_logprobs(model_cfg)(params, *host)), np.float32)
  return {**arr, "sampler_logprobs": np.where(arr["loss_mask"], lp, 0.0).astype(np.float32)}
