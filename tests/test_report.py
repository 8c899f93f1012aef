"""The report's expected-result checks and markdown (mopd_jax/report.py)."""


def test_report_checks_evaluate_the_bars():
  """Each bar is computed from the cells, the KL curve and the wall times; a missing policy
  leaves its checks undecided (None) rather than failed."""
  from mopd_jax import report
  from mopd_jax.tasks import TOY_DOMAINS
  lengths = {"low": 3.0, "high": 9.0, "max": 19.0}
  cells = []
  for d in TOY_DOMAINS:
    for e, n in lengths.items():
      cells.append({"policy": "sft", "domain": d, "effort": e, "accuracy": 0.5,
                    "mean_length": 19.0, "over_budget_rate": 0.0, "n": 8})
      cells.append({"policy": "teacher", "domain": d, "effort": e,
                    "accuracy": 0.6 if e == "max" else 0.4, "mean_length": n,
                    "over_budget_rate": 0.1 if (d, e) == ("cod", "low") else 0.0, "n": 8})
  grid = {"domains": list(TOY_DOMAINS), "efforts": {"low": 0.3, "high": 0.72, "max": 1.5}}
  rep = {"grid": grid, "cells": cells,
         "kl": {"initial": 2.0, "final": 0.5, "curve": [[0, 2.0], [1, 0.5]]},
         "wall_seconds": {"sft": 300.0, "rl": 400.0, "total": 1300.0}}
  got = {c["name"]: c["ok"] for c in report.checks(rep)}
  assert got["teacher gen/max accuracy - pi_SFT gen/max accuracy"] is True  # +0.10
  assert got["teacher gen mean length low < high < max"] is True
  assert got["teacher cod/low over-budget rate"] is False
  assert got["teacher agt/low over-budget rate"] is True
  assert got["student gen/max accuracy / teacher's"] is None  # no student cells
  assert got["per-token KL, first / last MOPD step"] is False  # a 4x drop
  assert got["teacher factory wall seconds (sft + rl)"] is True
  assert got["pipeline wall seconds"] is False
  assert "x4.0 drop" in report.markdown(rep)
  # The last step's value is a sampled-token estimate and can fall below 0: no ratio is
  # claimed, the bar stays undecided, and the first / last tenths' means are shown.
  curve = [[i, 0.2 - 0.025 * i] for i in range(10)]
  rep["kl"] = {"initial": 0.2, "final": curve[-1][1], "curve": curve}
  assert {c["name"]: c["ok"] for c in report.checks(rep)}[
      "per-token KL, first / last MOPD step"] is None
  md = report.markdown(rep)
  assert "no ratio" in md and "first / last 1 steps 0.2000 / -0.0250" in md, md
