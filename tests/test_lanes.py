"""RL lanes side by side (mopd_jax/stages/lanes.py): a failed lane process is named with its log."""
import os
import subprocess
import sys
import suite_cli

ROOT = suite_cli.ROOT


def test_failed_rl_lane_processes_are_named_with_their_logs(tmp_path):
  """Lanes side by side with no pi_SFT to start from: every lane process fails, and the
  stage names each lane, its exit status and the end of its log (in a fresh process with
  one CPU device, the config's mesh)."""
  code = ("import jax\nfrom configs import toy\nfrom mopd_jax import configure\n"
          "from mopd_jax.stages import context, lanes, rl, wiring\n"
          "config = configure.build(toy.get_config('fast'), jax.device_count())\n"
          f"run = wiring.rl_inputs(context.Run(config, {str(tmp_path)!r}))\n"
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

