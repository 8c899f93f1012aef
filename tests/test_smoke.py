"""The smoke stage (mopd_jax/stages/smoke.py) from the command line."""
import subprocess
import sys
import suite_cli

ROOT = suite_cli.ROOT


def test_qwen3_tiny_config_smoke_runs(tmp_path):
  env = suite_cli.env()
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path),
                         "--config.stages=smoke"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("sample=") == 3
