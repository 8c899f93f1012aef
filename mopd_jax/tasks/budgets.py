"""Base budgets b0(x) measured from samples of the parent policy (`budget.source=samples`).

b0(x) = ceil(1.1 x n), where n is the token count (EOS and tool observations included, as
the toy's rule counts them) of the shortest correct response among k samples of the parent
policy (pi_SFT, where every teacher starts) at the top effort, each capped at
`rollout.max_response_tokens`. A prompt with no correct sample has no b0: it is dropped from
every split that uses budgets, and counted.

Measured once, before the first budgeted effort (at the start of the rl stage), for every
split of every record domain, and stored beside the splits:

    <workdir>/budgets/<domain>.json   {"b0": {uid: b0 or null}, "k": k, "counts": {...}}

`BudgetedSource` is a split with those b0s applied: what `Run.split` returns afterwards.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import numpy as np

from mopd_jax.tasks import base as task_base

B0_MARGIN = task_base.B0_MARGIN


def measure(engine, params, task, *, examples: Sequence[task_base.Example],
            prompt_effort: Optional[str], k: int, rng, batch_size: int = 64) -> list:
  """Per example, b0 from its shortest correct response among `k` samples, or None."""
  best = [None] * len(examples)
  cap = engine.max_response_tokens
  for s in range(k):
    for lo in range(0, len(examples), batch_size):
      exs = list(examples[lo:lo + batch_size])
      res = engine.run(params, exs, [prompt_effort] * len(exs), budgets=[cap] * len(exs),
                       rng=jax.random.fold_in(jax.random.fold_in(rng, s), lo),
                       environment=task.environment)
      rewards = task.verify_unless(exs, res.texts, res.over_budget, fill=0.0)
      for j, (t, r) in enumerate(zip(res.trajectories, rewards)):
        if r >= 1.0 and (best[lo + j] is None or t.num_tokens < best[lo + j]):
          best[lo + j] = t.num_tokens
  return [None if n is None else int(math.ceil(B0_MARGIN * n - 1e-9)) for n in best]


class BudgetedSource:
  """A split's examples with measured b0s: examples without one are left out."""

  def __init__(self, source, b0: dict):
    self._source = source
    self._b0 = b0
    n = len(source)
    uids = [source[i].uid for i in range(n)]
    self._keep = [i for i, u in enumerate(uids) if b0.get(u) is not None]

  def __len__(self) -> int:
    return len(self._keep)

  def _with_b0(self, ex: task_base.Example) -> task_base.Example:
    return dataclasses.replace(ex, b0=int(self._b0[ex.uid]))

  def __getitem__(self, i: int) -> task_base.Example:
    return self._with_b0(self._source[self._keep[int(i)]])

  def __getitems__(self, indices) -> list:
    return [self[i] for i in indices]

  def __repr__(self):
    return f"BudgetedSource({self._source!r}, kept={len(self)})"


def distribution(b0s) -> dict:
  """The distribution of base budgets: n, mean and the 0/10/50/90/100th percentiles (what
  the data stage records and report.md shows)."""
  a = np.asarray(list(b0s), np.float64)
  q = np.percentile(a, [0, 10, 50, 90, 100]) if a.size else [0.0] * 5
  return {"n": int(a.size), "mean": float(a.mean()) if a.size else 0.0,
          **{k: float(v) for k, v in zip(("min", "p10", "p50", "p90", "max"), q)}}


def summary(b0: dict) -> dict:
  """Counts of a domain's measured b0s: with and without one, and their distribution."""
  d = distribution(v for v in b0.values() if v is not None)
  return {"measured": d.pop("n"), "no_correct_sample": sum(v is None for v in b0.values()),
          **d}
