"""The rl stage's lanes side by side, each in a process of its own (`rl.lane_processes`).

Lanes never share state (`stages.rl.train_lane`): each trains its own teachers from its own
checkpoint, data stream and rng, and keeps its records in its own directory until they join
the manifest. So running them side by side changes no number, only the wall time. On a CPU a
lane uses the cores poorly (its decode loop runs many small ops: the toy RL stage ran only
1.26x faster on two cores than on one), so three lane processes on two cores finish sooner
than three lanes one after another. On one accelerator keep `rl.lane_processes=1`: the
processes would compete for its memory. A multi-host run (jax.distributed) always runs its
lanes one after another, every host taking part in each.

The rl stage spawns, per lane,

    python -m mopd_jax.lanes --workdir DIR --lane N --config DIR/rl/lanes_config.json

(the lane worker, mopd_jax/lanes.py) which reads the run's resolved config from the file it
is given, writes its console output to <lane dir>/lane.log (through a local mirror copied up
when the lane ends, for a workdir on object storage: mopd_jax/io/storage.py) and its
progress to <lane dir>/progress.json (the parent draws one bar per lane from these), and
exits with the pipeline's preemption code after a SIGTERM (which the parent forwards): every
lane has then saved its step, and the same command resumes each lane where it stopped. A
failed lane does not stop the others; the stage then raises, naming it and its log, and a
re-run trains only what is missing.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Sequence

import jax

from mopd_jax.io import checkpoint, storage

RECORDS = "records.json"  # a lane's finished teachers: its manifest section's entries
PROGRESS = "progress.json"
COMPILE = "compile.json"  # a lane worker's wall and compile seconds, written at its end
LOG = "lane.log"


def check_processes(c) -> int:
  """`rl.lane_processes` of the `rl` config `c`, checked (no JAX call: the config is built
  before jax.distributed starts)."""
  k = c.lane_processes
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"rl.lane_processes={k!r}; expected an integer >= 1 (1 = the lanes one "
                     "after another in this process)")
  return k


def process_count(c, num_lanes: int) -> int:
  """How many lane processes the `rl` config `c` asks for, and this run allows."""
  k = check_processes(c)
  if jax.process_count() > 1:
    return 1
  return min(k, num_lanes)


def read_records(lane) -> dict:
  return checkpoint.read_json(storage.join(lane.directory, RECORDS), default={})


def _finished(lane) -> bool:
  records = read_records(lane)
  return all(f"{lane.domain}/{e}" in records and
             storage.exists(storage.join(lane.directory, f"teacher_{e}"))
             for e in lane.efforts)


def run_side_by_side(workdir: str, config_json: str, lanes: Sequence, *, processes: int,
                     total_steps: Sequence[int]) -> None:
  """Runs the unfinished `lanes` in at most `processes` worker processes at a time; returns
  once all have finished. Each worker gets the run's resolved config (`config_json`, written
  to <workdir>/rl/lanes_config.json) explicitly; `total_steps[i]` is lane i's step count
  (its progress bar). Raises `checkpoint.Preempted` after a SIGTERM (forwarded to the
  workers, which save their step first), RuntimeError if a lane failed."""
  from tqdm.auto import tqdm

  config_path = storage.join(workdir, "rl", "lanes_config.json")
  storage.write_text(config_path, config_json)
  env = dict(os.environ)
  # On a GPU each process would otherwise reserve most of the memory for itself.
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  todo = [i for i, lane in enumerate(lanes) if not _finished(lane)]
  bars = {}
  for i in todo:
    bars[i] = tqdm(total=total_steps[i], desc=f"rl lane {lanes[i].name}", unit="step",
                   position=len(bars), dynamic_ncols=True, mininterval=1.0)
  running, failed, preempted, mirrors = {}, [], False, {}
  pending = list(todo)
  try:
    while pending or running:
      while pending and len(running) < processes and not preempted:
        i = pending.pop(0)
        mirrors[i] = storage.LocalMirror(lanes[i].directory)  # the subprocess writes its log
        log = open(os.path.join(mirrors[i].local, LOG), "a")  # local: the mirror's folder
        cmd = [sys.executable, "-m", "mopd_jax.lanes", "--workdir", workdir,
               "--lane", str(i), "--config", config_path]
        running[i] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
      if checkpoint.preemption_requested() and not preempted:
        preempted = True
        pending.clear()
        for proc, _ in running.values():
          proc.send_signal(signal.SIGTERM)
      time.sleep(0.5)
      for i in list(running):
        _show(bars[i], lanes[i])
        proc, log = running[i]
        if proc.poll() is None:
          continue
        log.close()
        mirrors[i].sync()
        del running[i]
        if proc.returncode == checkpoint.PREEMPTED_EXIT_CODE:
          preempted = True
        elif proc.returncode != 0 and not preempted:
          # After a forwarded SIGTERM any exit counts as preempted: a lane still importing
          # had no handler yet, and had nothing to save.
          failed.append((i, lanes[i], proc.returncode))
  finally:
    for proc, log in running.values():  # only on an exception here (e.g. KeyboardInterrupt)
      proc.send_signal(signal.SIGTERM)
      proc.wait()
      log.close()
    for bar in bars.values():
      bar.close()
    tails = {i: _tail(mirrors[i]) for i in mirrors}
    for m in mirrors.values():
      m.close()
  if preempted:
    raise checkpoint.Preempted("SIGTERM: every RL lane saved its step. Run the same command "
                               "again to continue.")
  if failed:
    lines = []
    for i, lane, code in failed:
      path = storage.join(lane.directory, LOG)
      lines.append(f"lane {lane.name} exited with code {code}; its log {path} ends:\n"
                   f"{tails[i]}")
    raise RuntimeError("RL lane(s) failed (the other lanes' teachers are kept; re-running "
                       "trains only what is missing):\n" + "\n".join(lines))


def _tail(mirror: storage.LocalMirror, lines: int = 15) -> str:
  path = os.path.join(mirror.local, LOG)  # local: the mirror's folder
  try:
    with open(path, errors="replace") as f:  # local: the mirror's folder
      return "".join(f.readlines()[-lines:])
  except OSError:
    return ""


def _show(bar, lane) -> None:
  p = checkpoint.read_json(storage.join(lane.directory, PROGRESS), default={"done": 0})
  if p["done"] > bar.n:
    bar.set_postfix({k: f"{p[k]:.3f}" if isinstance(p[k], float) else p[k]
                     for k in ("effort", "reward", "length") if k in p}, refresh=False)
    bar.update(p["done"] - bar.n)
