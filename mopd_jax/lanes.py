"""The RL lane worker: `python -m mopd_jax.lanes --workdir DIR --lane N --config FILE` trains
one lane of the rl stage in a process of its own. The rl stage spawns one per lane through
`mopd_jax.stages.lanes` (the launcher: the processes, their bars, SIGTERM forwarded), which
documents the protocol; this worker sits above the stages it runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import ml_collections

from mopd_jax import configure
from mopd_jax.io import checkpoint, profiling, storage
from mopd_jax.stages import lanes as launch, rl as rl_stage, wiring
from mopd_jax.stages.context import Run


def main(argv=None) -> None:
  """The lane worker: lane `--lane` of the run whose resolved config is `--config`, trained
  by the rl stage's `train_lane`, its finished teachers kept in the lane's records."""
  parser = argparse.ArgumentParser(description="One lane of the rl stage (spawned by it).")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--lane", type=int, required=True)
  parser.add_argument("--config", required=True, help="the run's resolved config (JSON)")
  args = parser.parse_args(argv)
  config = ml_collections.ConfigDict(json.loads(storage.read_text(args.config)))
  inp = wiring.rl_inputs(Run(configure.build(config, jax.device_count()), args.workdir))
  lane = rl_stage.lanes_of(inp)[args.lane]
  storage.makedirs(lane.directory)
  # Teachers this lane finished in an earlier run of the lanes one after another count too.
  manifest = checkpoint.read_json(inp.files.path(rl_stage.MANIFEST), default={})
  names = {f"{lane.domain}/{e}" for e in lane.efforts}
  record = {k: v for k, v in manifest.get(lane.section, {}).items()
            if k in names and v.get("origin") != "outside"}
  record.update(launch.read_records(lane))
  steps = rl_stage.lane_steps(inp, lane)
  progress = storage.join(lane.directory, launch.PROGRESS)

  def on_step(effort, step, m):
    done = sum(steps[:lane.efforts.index(effort)]) + step + 1
    checkpoint.write_json(progress, {"done": done, "effort": effort, "reward": m["reward"],
                                     "length": m["length"]})

  profiling.CompileClock.read()  # listen from here on
  t0 = time.time()
  try:
    with checkpoint.sigterm_guard():
      for name, entry in rl_stage.train_lane(inp, lane, record, on_step=on_step):
        record[name] = entry
        checkpoint.write_json(storage.join(lane.directory, launch.RECORDS), record)
    seconds, programs = profiling.CompileClock.read()
    checkpoint.write_json(storage.join(lane.directory, launch.COMPILE), {
        "wall_seconds": time.time() - t0, "compile_seconds": seconds, "programs": programs})
  except checkpoint.Preempted as e:
    print(f"PREEMPTED: {e}", file=sys.stderr, flush=True)
    sys.exit(checkpoint.PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
  main()
