"""The report stage: report.json, report.md and the PNG plots (mopd_jax/evaluation/report.py). The
stage takes its `Inputs` (built by `stages/wiring.py`)."""
from __future__ import annotations

import dataclasses
import json

from mopd_jax.evaluation import report
from mopd_jax.io import checkpoint, storage
from mopd_jax.stages import lanes, loops
from mopd_jax.tasks import grid as grid_mod


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the report stage reads: the run's resolved config (`config_json`, recorded in the
  report), its grid and its files."""
  config_json: str
  grid: grid_mod.Grid
  files: loops.Workdir


def run(inp: Inputs) -> None:
  timings = checkpoint.read_json(inp.files.path("timings.json"), default={"_": 0})
  timings.pop("_", None)
  compile_seconds = timings.pop("compile", {})  # per stage: {seconds, programs} (pipeline.py)
  timings["total"] = sum(timings.values())
  # Each RL lane process records its own (mopd_jax/stages/lanes.py); lanes run side by side.
  for d in inp.grid.domains:
    path = inp.files.path("rl", d, lanes.COMPILE)
    if storage.exists(path):  # lanes run in this process leave none
      lane = checkpoint.read_json(path)
      compile_seconds[f"rl lane {d}"] = {"seconds": lane["compile_seconds"],
                                         "programs": lane["programs"],
                                         "wall": lane["wall_seconds"]}
  rep = report.write(inp.files.root, json.loads(inp.config_json), timings, grid=inp.grid,
                     compile_seconds=compile_seconds)
  inp.files.mark_done("report", {"kl": rep["kl"]["final"]})
  print(f"report: {inp.files.path('report.md')}")
