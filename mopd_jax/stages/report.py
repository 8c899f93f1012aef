"""The report stage: report.json, report.md and the PNG plots (mopd_jax/report.py)."""
from __future__ import annotations

import json

from mopd_jax import checkpoint, report
from mopd_jax.stages.context import Run


def run(ctx: Run) -> None:
  timings = checkpoint.read_json(ctx.path("timings.json"), default={"_": 0})
  timings.pop("_", None)
  timings["total"] = sum(timings.values())
  rep = report.write(ctx.workdir, json.loads(ctx.config.to_json()), timings, grid=ctx.grid)
  ctx.mark_done("report", {"kl": rep["kl"]["final"]})
  print(f"report: {ctx.path('report.md')}")
