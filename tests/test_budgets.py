"""b0 from samples of the parent policy (mopd_jax/tasks/budgets.py): the shortest correct of k
samples, with the toy's margin; no correct sample, no b0, and the example leaves the split."""
import jax
import numpy as np

from mopd_jax.rollout import turns as rollout
from mopd_jax.tasks import base, budgets


class _Engine:
  """Samples k = 0, 1, 2: responses of lengths 10, 4 and 7 tokens; correct when the text
  says so."""
  max_response_tokens = 32

  def __init__(self):
    self.calls = []

  def run(self, params, exs, efforts, *, budgets, rng, environment=None):
    del params, rng, environment
    self.calls.append((list(efforts), list(budgets)))
    k = len(self.calls) - 1
    n = (10, 4, 7)[k]
    texts, trajs = [], []
    for ex in exs:
      ok = ex.prompt == "always" or (ex.prompt == "long only" and n == 10)
      texts.append("#1" if ok else "#0")
      trajs.append(rollout.Trajectory([1], [5] * n, [1] * n, [0.0] * n, True))
    return rollout.RolloutResult(trajs, texts, np.zeros(len(exs), bool))


class _Task(base.Task):
  def _verify(self, example, response):
    return float(response == "#1")


def test_shortest_correct_sample_sets_b0_and_no_correct_sample_drops_the_example():
  exs = [base.Example(f"u{i}", "m", p, 1, "1") for i, p in
         enumerate(["always", "long only", "never"])]
  engine = _Engine()
  got = budgets.measure(engine, None, _Task(), examples=exs, prompt_effort=None, k=3,
                        rng=jax.random.PRNGKey(0))
  assert got == [int(np.ceil(1.1 * 4)), 11, None]  # shortest correct: 4 and 10 tokens
  assert engine.calls[0] == ([None] * 3, [32] * 3)  # the teachers' prompt, capped only
  src = budgets.BudgetedSource(exs, dict(zip(["u0", "u1", "u2"], got)))
  assert len(src) == 2 and [e.b0 for e in src.__getitems__([0, 1])] == [5, 11]
  s = budgets.summary(dict(zip(["u0", "u1", "u2"], got)))
  assert s["measured"] == 2 and s["no_correct_sample"] == 1 and s["min"] == 5
