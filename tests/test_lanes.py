"""RL lanes side by side (mopd_jax/lanes.py): a failed lane process is named with its log."""
import os
import subprocess
import sys
import suite_cli

ROOT = suite_cli.ROOT


def test_failed_rl_lane_processes_are_named_with_their_logs(tmp_path):
  """Lanes side by side with no pi_SFT to start from: every lane process fails, and the
  stage names each lane, its exit status and the end of its log (in a fresh process with
  one CPU device, the config's mesh)."""
  code = ("from configs import toy\nfrom mopd_jax import lanes\n"
          "from mopd_jax.stages import context, rl, wiring\n"
          f"run = wiring.rl_inputs(context.Run(toy.get_config('fast'), {str(tmp_path)!r}))\n"
          "lanes_ = rl.lanes_of(run)\n"
          "try:\n  lanes.run_side_by_side(run.files.root, run.config_json, lanes_, "
          "processes=3, total_steps=[sum(rl.lane_steps(run, lane)) for lane in lanes_])\n"
          "except RuntimeError as e:\n  print('RuntimeError:', e)\n")
  env = suite_cli.env()
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  out = proc.stdout
  assert "RuntimeError: RL lane(s) failed" in out, out + proc.stderr[-3000:]
  for d in ("gen", "agt", "cod"):
    assert f"lane {d} exited with code 1" in out
    assert os.path.exists(tmp_path / "rl" / d / "lane.log")
  assert "sft/params" in out  # the cause, from the logs' tails
  assert not os.path.exists(tmp_path / "teachers.json")


def test_lanes_projected_to_finish_early_are_lowered():
  """The slow lane keeps its priority; lanes projected to end well before it are lowered,
  and only once every lane has done enough steps to project from."""
  from mopd_jax import lanes
  # (start, steps done, steps left, now): lane 1 runs at half the others' rate.
  progress = {0: (0.0, 6, 54, 30.0), 1: (0.0, 6, 54, 60.0), 2: (1.0, 7, 53, 31.0)}
  assert lanes.lanes_to_lower(progress) == [0, 2]
  assert lanes.lanes_to_lower({**progress, 2: (1.0, 4, 56, 31.0)}) == []  # too few steps
  assert lanes.lanes_to_lower({0: (0.0, 6, 54, 57.0), 1: (0.0, 6, 54, 60.0)}) == []  # close
  assert lanes.lanes_to_lower({0: progress[0]}) == []  # nothing to give way to


def test_lowering_raises_a_processes_niceness():
  from mopd_jax import lanes
  proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
  try:
    before = os.getpriority(os.PRIO_PROCESS, proc.pid)
    lanes._lower(proc.pid)
    assert os.getpriority(os.PRIO_PROCESS, proc.pid) == before + lanes.LOWER_BY or \
        before + lanes.LOWER_BY > 19  # niceness is capped at 19
  finally:
    proc.kill()
    proc.wait()
  lanes._lower(proc.pid)  # an exited lane: nothing happens
