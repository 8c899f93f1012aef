"""How the MOPD steps' KL curves ([[step, value], ...] in `mopd/history.json`'s records and
report.json) reduce to the report's drops: the means over the first and the last tenth of a
run's steps, for the run and for each cell."""
from __future__ import annotations

import numpy as np


def kl_windows(curve) -> tuple:
  """(head, tail): the values of a [[step, value], ...] curve in the first and in the last
  tenth of its span of steps (at least one step each). A curve measured every step holds a
  tenth of its points in each; one measured every k steps (`mopd.exact_kl_every`) holds
  those that fall in them, and the MOPD stage measures every step of the last tenth."""
  steps = [s for s, _ in curve]
  vals = np.asarray([v for _, v in curve], np.float64)
  n = max(1, (steps[-1] - steps[0] + 1) // 10)
  return (vals[[s < steps[0] + n for s in steps]], vals[[s > steps[-1] - n for s in steps]])


def kl_window_means(curve) -> tuple:
  """(first, last, n_first, n_last): the means of `kl_windows`' head and tail and how many
  points each holds."""
  head, tail = kl_windows(curve)
  return float(head.mean()), float(tail.mean()), len(head), len(tail)


def kl_drop(rep: dict) -> tuple:
  """(ratio, source): how far the per-token KL of the student to its routed teachers falls
  over the MOPD run: the mean over its first tenth of steps over the mean over its last
  tenth (every step of which the stage measures), of the exact full-vocabulary KL where
  measured (`mopd.exact_kl_every`, "exact"; pi_SFT's before the teacher-SFT init,
  mopd/start.json, replaces the first tenth), else of the sampled-token estimate
  ("sampled"). A step's value is an estimate from a few dozen rollouts, one of which, off its
  teacher's style, can move it 10x. (None, source) when there is nothing to measure or the
  end's KL is at or below 0. The held-out measure (`agreement.heldout_drop`) is shown beside it."""
  exact = rep.get("kl_exact_curve") or []
  curve, source = (exact, "exact") if len(exact) >= 2 else (rep["kl"].get("curve") or [],
                                                             "sampled")
  if len(curve) < 2:
    return None, source
  first, last, _, _ = kl_window_means(curve)
  start = rep.get("kl_start")
  if start and source == "exact":  # the distillation starts at pi_SFT, before its init
    first, source = start["kl_exact"], "exact, from pi_SFT before the teacher-SFT init"
  return (first / last if last > 0 else None), source


def kl_drop_per_cell(per_cell: dict) -> dict:
  """{cell: {first, last, n, drop}} of each cell's [[step, KL], ...] curve, reduced as
  `kl_drop` reduces the run's: the means over the first and the last tenth of its steps
  (n points in the last), and their ratio (None when the last tenth's mean is at or below 0)."""
  out = {}
  for name, curve in per_cell.items():
    if curve:
      first, last, _, n = kl_window_means(curve)
      out[name] = {"first": first, "last": last, "n": n,
                   "drop": first / last if last > 0 else None}
  return out
