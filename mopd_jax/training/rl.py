"""Domain RL with an annealed length budget: one lane per domain, three frozen teachers each.

A lane starts from pi_SFT and runs the efforts from the largest tau down (the toy's
max -> high -> low), each continuing
from the previous one. A trajectory scores -1 once it exceeds `tau_e * b0(x)` tokens
(decoding is cut there), else the verifier's reward. The default optimiser is the Kimi
K1.5/K2 policy-mirror-descent squared loss over K samples per prompt; GRPO with the clipped
ratio loss is an option (`rl.loss`). After each effort the lane freezes teacher (d, e):
params to `<lane_dir>/teacher_<e>` (orbax) and a manifest entry with its eval metrics.

Each phase has its own PMD old policy, learning rate and tau_kl (`phase_settings`). The toy's
max phase is policy iteration (old policy = the sampler), which commits the teacher to its
domain's most accurate style; the budget phases then start from a teacher that writes only
that style, so all their first samples run over budget and score -1 alike (no advantage).
Holding them to pi_SFT instead (old policy = "sft") pulls the shorter styles back, and the
budget's reward chooses among them.

Lanes share nothing: each has its own directory, iterator, rng stream and optimizer, so they
can run one after another in one process or side by side as separate processes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax.rollout import partial, turns as rollout
from mopd_jax.tasks import base as task_base, views
from mopd_jax.training import step as train

REFERENCES = ("sampler", "sft", "parent")
# Which policy draws a phase's samples (`rl.sample_from`): "policy" (the one being trained,
# on-policy) | "reference" (PMD's old policy when a phase holds it fixed: Kimi K1.5's policy
# mirror descent draws each iteration's samples from its old policy, so the squared loss
# regresses log pi / pi_old onto the advantage on samples that cover every behaviour the old
# policy has; a phase whose old policy is "sampler" draws from the policy either way).
# "both": half of each prompt's K samples from each (the first K // 2 from the policy): the
# old policy's samples keep every style in the batch, and the policy's own ones put its
# mistakes there to be penalised.
SAMPLE_FROM = ("policy", "reference", "both")


def references(spec: str, phases) -> dict:
  """`rl.reference` -> {effort: PMD old policy} for a lane's `phases` (effort names in anneal
  order, largest tau first). The spec is one value for every phase, two (the first phase,
  then every budget phase), or one per phase, comma-separated ("sampler,sft"). "sampler":
  the policy that sampled the batch (one update old: policy iteration); "sft": the lane's
  start (pi_SFT), held fixed; "parent": the effort's parent teacher (pi_SFT for the first
  phase), held fixed for the phase."""
  phases = tuple(phases)
  kinds = [k.strip() for k in str(spec).split(",")]
  if not set(kinds) <= set(REFERENCES) or len(kinds) not in (1, 2, len(phases)):
    raise ValueError(f"rl.reference={spec!r}: expected one of {REFERENCES}; one value, two "
                     f"(first phase, budget phases) or one per phase {phases}, separated by "
                     "commas (e.g. 'sampler,sft')")
  if len(kinds) != len(phases):  # one value for all, or (first phase, budget phases)
    kinds = kinds[:1] + kinds[-1:] * (len(phases) - 1)
  return dict(zip(phases, kinds))


def phase_settings(c, effort: str, phases) -> dict:
  """PMD old policy, learning rate, tau_kl and step count of one effort phase of the `rl`
  config `c` (`phases`: the lane's efforts in anneal order): the first phase uses
  `lr`/`tau_kl`/`steps_per_effort`; the budget phases after it use
  `anneal_lr`/`anneal_tau_kl`/`anneal_steps`, each falling back to the first phase's value
  when 0."""
  anneal = effort != tuple(phases)[0]
  return {"reference": references(c.reference, phases)[effort],
          "lr": (anneal and c.anneal_lr) or c.lr,
          "tau_kl": (anneal and c.anneal_tau_kl) or c.tau_kl,
          "steps": (anneal and c.anneal_steps) or c.steps_per_effort}


def rl_batch(tok, trajs, rewards, *, width: int, relogprob=None,
             params=None) -> train.TrainBatch:
  """The update's batch; `relogprob(arr, params)`: the padded arrays with their sampler
  log-probs replaced by those of `params` (partial rollouts, mode "recompute")."""
  arr = rollout.pad_batch(trajs, tok.pad_id, width)
  if relogprob is not None:
    arr = relogprob(arr, params)
  return train.TrainBatch.from_padded(arr, sampler_logprobs=True,
                                      rewards=jnp.asarray(rewards, jnp.float32))


def rewards_of(task, examples, result: rollout.RolloutResult) -> np.ndarray:
  """Verifier score, or -1 for a trajectory cut at its budget."""
  return np.asarray(task.verify_unless(examples, result.texts, result.over_budget, fill=-1.0),
                    np.float32)


def plateaued(history, window: int, delta: float) -> bool:
  """The reward-plateau stopping rule: True once the mean sample reward of the last `window`
  steps exceeds that of the `window` steps before by less than `delta`. `window` 0 = off.
  `history`: [(step, metrics)] in step order."""
  if window <= 0 or len(history) < 2 * window:
    return False
  r = [h[1]["reward"] for h in history[-2 * window:]]
  return float(np.mean(r[window:]) - np.mean(r[:window])) < delta


def _run_split(engine: rollout.RolloutEngine, samplers: tuple, rows: list, *, shown: list,
               budgets: list, rng, group_size: int, environment) -> rollout.RolloutResult:
  """`sample_from="both"`: the first `group_size // 2` samples of each prompt's group drawn by
  `samplers[0]`, the rest by `samplers[1]`, returned in the rows' order."""
  half = group_size // 2
  parts = [[i for i in range(len(rows)) if (i % group_size < half) == first]
           for first in (True, False)]
  trajs, texts = [None] * len(rows), [None] * len(rows)
  lengths = np.zeros(len(rows), int)  # in the tokens budgets are counted in
  for j, (params, idx) in enumerate(zip(samplers, parts)):
    if not idx:
      continue
    res = engine.run(params, [rows[i] for i in idx], [shown[i] for i in idx],
                     budgets=[budgets[i] for i in idx], rng=jax.random.fold_in(rng, j),
                     environment=environment)
    for k, i in enumerate(idx):
      trajs[i], texts[i] = res.trajectories[k], res.texts[k]
    lengths[idx] = res.lengths
  return engine.result(trajs, budgets, texts=texts, counted=lengths)


@dataclasses.dataclass(frozen=True)
class EffortPhase:
  """One effort phase of a lane: at most `steps` RL iterations at effort `effort` (budget
  `tau * b0`), `group_size` samples per prompt, batches padded to at least `width`. `phase`:
  the effort's place in its lane's anneal (0 = the largest tau), which with `seed` salts the
  sampling rng. `plateau` = (window, delta): stop early once the reward plateaus (see
  `plateaued`). `start_step`: the first step when no `checkpoint.TrainLoop` restores one."""
  effort: str
  tau: float
  phase: int
  steps: int
  group_size: int
  width: int
  seed: int
  plateau: tuple = (0, 0.0)
  start_step: int = 0


@dataclasses.dataclass(frozen=True)
class PhaseSampling:
  """How a phase's samples are drawn: by `engine`, with prompts as `view` shows them to a
  teacher (`view.teacher(effort)`; None in K3 eq. 15: the teacher learns the effort's length
  from the budget alone).

  `reference`: params held as PMD's old policy for the whole phase (`rl.reference` "sft" or
  "parent"), instead of the policy that sampled each batch. `sample_from` "reference": that
  held policy, not the policy being trained, draws the phase's samples; "both": half of each
  prompt's samples from each (`SAMPLE_FROM`).

  `pool`: partial rollouts (`partial.py`): each step's samples join the pool, every
  incomplete row decodes one more segment, and the update trains on the complete groups
  (every sample of a prompt complete; at most a step's worth, oldest first), padded with
  empty rows to one shape. `relogprob`: see `rl_batch`."""
  engine: rollout.RolloutEngine
  view: views.PromptView = views.K3
  reference: Any = None
  sample_from: str = "policy"
  pool: Optional[partial.RolloutPool] = None
  relogprob: Optional[Callable] = None


def run_effort(trainer: train.Trainer, state: train.TrainState, sampling: PhaseSampling, *,
               task, next_examples: Callable[[int], list], phase: EffortPhase, loop=None,
               log: Optional[Callable] = None):
  """At most `phase.steps` RL iterations at one effort level, fewer when the reward
  plateaus; returns the new state and per-step metrics (their count is the number of steps
  run). `sampling`: the engine, view, held reference and partial-rollout pool that draw the
  samples (`PhaseSampling`).

  `loop`: a `checkpoint.TrainLoop` (per-step checkpoints, SIGTERM, non-finite policy); the
  run then starts at `loop.start_step` and the returned history includes restored steps.
  `log(step, metrics)` is called after every step.
  """
  engine, view, reference = sampling.engine, sampling.view, sampling.reference
  sample_from, pool, relogprob = sampling.sample_from, sampling.pool, sampling.relogprob
  effort, tau, steps, group_size = phase.effort, phase.tau, phase.steps, phase.group_size
  start_step, plateau = phase.start_step, phase.plateau
  if sample_from not in SAMPLE_FROM:
    raise ValueError(f"sample_from={sample_from!r}; expected one of {SAMPLE_FROM}")
  if sample_from == "both" and reference is not None and pool is not None:
    raise ValueError("sample_from='both' draws each step's samples whole; it does not "
                     "combine with partial rollouts")
  history = []
  if loop is not None:
    start_step, history = loop.start_step, loop.history
  for step in range(start_step, steps):
    held = sample_from == "reference" and reference is not None
    sampler = reference if held else state.params
    # Checked before the step, so a phase resumed from its checkpoint stops where it did.
    if plateaued(history, *plateau):
      break
    exs = next_examples(step)
    rows = [ex for ex in exs for _ in range(group_size)]
    budgets = [task_base.budget(ex, tau) for ex in rows]
    # A pure function of (seed, phase, step): a resumed lane draws the same samples.
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(phase.seed), phase.phase),
                             step)
    shown = [view.teacher(effort)] * len(rows)
    if pool is None and sample_from == "both" and reference is not None:
      res = _run_split(engine, (state.params, reference), rows, shown=shown,
                       budgets=budgets, rng=rng,
                       group_size=group_size, environment=task.environment)
      trajs = res.trajectories
    elif pool is None:
      res = engine.run(sampler, rows, shown, budgets=budgets, rng=rng, environment=task.environment)
      trajs = res.trajectories
    else:
      pool.add(engine, rows, shown, rng=rng, step=step, budgets=budgets,
               groups=[step * len(exs) + i // group_size for i in range(len(rows))])
      taken = []
      while not taken:  # the first steps may have nothing complete yet: decode on
        pool.advance(engine, sampler, rng, environment_of=lambda d: task.environment)
        taken = pool.take_groups(engine, len(exs))
      rows, trajs = [r.example for r in taken], [r.traj for r in taken]
      res = engine.result(trajs, [pool.budget_of(engine, r) for r in taken])
    rewards = rewards_of(task, rows, res)
    longest = max(len(t.prompt_ids) + t.num_tokens for t in trajs)
    w = rollout.padded_width(longest, pow2=True, floor=phase.width)
    n_empty = len(exs) * group_size - len(trajs)  # whole empty groups: no loss, one shape
    empty = rollout.empty_rows(trajs[0], n_empty)
    state, m = trainer.step(state, rl_batch(engine.tok, trajs + empty,
                                            np.concatenate([rewards, np.zeros(n_empty)]),
                                            width=w, relogprob=relogprob,
                                            params=state.params),
                            reference=reference)
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    m.update(reward=float(rewards.mean()), accuracy=float((rewards > 0).mean()),
             over_budget=float(res.over_budget.mean()), length=float(res.lengths.mean()))
    if pool is not None:
      m.update(in_flight=float(len(pool.rows)), rows=float(len(trajs)))
    if loop is not None:
      loop.end_step(step, state, m, record=[step, m])  # appends to `history`
    elif not m["finite"]:
      raise FloatingPointError(f"RL {task.name}/{effort} step {step}: non-finite loss "
                               f"{m['loss']} or grad norm {m['grad_norm']}")
    else:
      history.append((step, m))
    if log is not None:
      log(step, m)
  return state, history
