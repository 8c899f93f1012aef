"""Partial rollouts: segments carried across steps equal one-go rollouts; the pool's
selection and its checkpointed state."""
import dataclasses
import json

import jax
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.io.tokenizer import CharTokenizer
from mopd_jax.rollout import partial, turns as rollout
from mopd_jax.tasks import get_task

TOK = CharTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=256)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.PRNGKey(0))


def _engine():
  return rollout.RolloutEngine(CFG, TOK, max_response_tokens=40, max_turns=1)


def _same(a, b):
  assert a.ids == b.ids and a.gen_mask == b.gen_mask and a.finished == b.finished
  assert a.turns == b.turns
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.mark.slow  # test_rollout.py::test_partial_rollout_equals_one_go is the guard
def test_segments_equal_one_go_rollouts(params):
  """Rows decoded 6 tokens per step (agt with tool observations, and gen) are the one-go
  rollouts of the same keys, tool-turn limit included."""
  eng = _engine()
  rng = jax.random.PRNGKey(3)
  tasks = {d: get_task(d) for d in ("agt", "gen")}
  exs = {d: t.generate(0, 4) for d, t in tasks.items()}
  pool = partial.RolloutPool(6)
  for j, d in enumerate(tasks):
    pool.add(eng, exs[d], ["max"] * 4, rng=jax.random.fold_in(rng, j), step=0)
  steps = 0
  while not all(pool.complete(eng, r) for r in pool.rows):
    pool.advance(eng, params, rng, environment_of=lambda d: tasks[d].environment)
    steps += 1
  assert steps > 1  # the rows took several segments
  for j, d in enumerate(tasks):
    whole = eng.run(params, exs[d], ["max"] * 4, budgets=[40] * 4, rng=jax.random.fold_in(rng, j),
                    environment=tasks[d].environment)
    for a, r in zip(whole.trajectories, [r for r in pool.rows if r.example.domain == d]):
      _same(a, r.traj)


def test_take_limits_each_cell_and_the_state_round_trips(params):
  """`take` returns complete rows oldest first, at most `limit` per cell, and keeps the rest;
  the pool's JSON state restores a pool whose next segments are the same."""
  eng = _engine()
  task = get_task("gen")
  pool = partial.RolloutPool(5)
  pool.add(eng, task.generate(0, 3), ["low", "max", "max"], rng=jax.random.PRNGKey(1), step=0)
  pool.add(eng, task.generate(1, 3), ["max", "max", "low"], rng=jax.random.PRNGKey(2), step=1)
  for r in pool.rows[:4]:  # mark four complete by hand: two of step 0, two of step 1
    r.traj.finished = True
  cell = lambda r: r.effort
  taken = pool.take(eng, cell, limit=2)
  # The fourth complete row (step 1, max) would be max's third: it waits.
  assert [(r.born, r.effort) for r in taken] == [(0, "low"), (0, "max"), (0, "max")]
  assert [(r.born, r.effort, r.traj.finished) for r in pool.rows] == [
      (1, "max", True), (1, "max", False), (1, "low", False)]
  for r in pool.rows:
    r.traj.finished = False
  pool.advance(eng, params, jax.random.PRNGKey(0), environment_of=lambda d: task.environment)
  copy = partial.RolloutPool(5)
  copy.restore(json.loads(json.dumps(pool.state())))
  for p in (pool, copy):
    p.advance(eng, params, jax.random.PRNGKey(0), environment_of=lambda d: task.environment)
  assert len(copy.rows) == len(pool.rows)
  for a, b in zip(pool.rows, copy.rows):
    _same(a.traj, b.traj)
    assert a.example == b.example and a.effort == b.effort and a.born == b.born
  with pytest.raises(ValueError, match="partial_rollout_tokens must be an int >= 1"):
    partial.RolloutPool(0)


@pytest.mark.slow  # the pool: test_take_limits_each_cell_and_the_state_round_trips
def test_rl_effort_phase_with_partial_rollouts(params):
  """`rl.run_effort` with a pool: segments of 1000 tokens (every row completes in its
  step) give the history of the loop without one; segments of 5 tokens train only on
  whole groups (multiples of the group size), carry rows over, and with "recompute" the
  batch's sampler log-probs are the updated policy's own."""
  from mopd_jax.runtime import sharding
  from mopd_jax.training import rl, step as train
  task = get_task("gen")
  # Two budgets per step (1.5 x b0: 12 and 36 tokens), so groups complete at different steps.
  stream = [[dataclasses.replace(ex, b0=b0) for ex, b0 in zip(task.generate(k, 2), (8, 24))]
            for k in range(4)]
  mesh = sharding.make_mesh({}, jax.devices()[:1])

  trainer = train.Trainer(CFG, train.LossConfig(kind="pmd", group_size=2, tau_kl=0.5),
                          train.OptimConfig(lr=1e-3, warmup_steps=0, total_steps=3), mesh=mesh)

  def run(pool, relogprob=None):  # one Trainer (its compiled step) for the three runs
    _, hist = rl.run_effort(trainer, trainer.init(params),
                            rl.PhaseSampling(_engine(), pool=pool, relogprob=relogprob),
                            task=task, next_examples=lambda step: stream[step],
                            phase=rl.EffortPhase(effort="max", tau=1.5, phase=0, steps=3,
                                                 group_size=2, width=64, seed=0))
    return hist

  plain, whole = run(None), run(partial.RolloutPool(1000))
  assert [m["loss"] for _, m in plain] == [m["loss"] for _, m in whole]
  seen = []
  hist = run(partial.RolloutPool(5), relogprob=lambda arr, p: seen.append(arr) or
             partial.recompute_logprobs(CFG, p, arr))
  assert all(m["rows"] % 2 == 0 and m["rows"] >= 2 for _, m in hist)
  assert any(m["in_flight"] > 0 for _, m in hist)
  assert all(np.isfinite(m["loss"]) for _, m in hist) and len(seen) == 3
