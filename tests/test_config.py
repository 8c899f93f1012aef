"""Config validation: clear errors before compilation, also under `python -O`."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = [
    ("c.mesh.data = 2", "mesh"),
    ("c.effort.tau_high = 1.5", "strictly ordered"),
    ("c.effort.tau_low = 0.8", "strictly ordered"),
    ("c.mopd.r_max = 0.0", "r_max"),
    ("c.mopd.loss = 'kl'", "mopd.loss"),
    ("c.checkpoint.every = 0", "checkpoint.every"),
    ("c.mopd.staleness = 2", "mopd.staleness"),
    ("c.sft.schedule = 'gen,agt'", "sft.schedule"),
    ("c.sft.schedule = 'gen,agt,cod,math'", "unknown: ['math']"),
    ("c.sft.style_weights.agt = (1.0, 2.0)", "one per style"),
    ("c.sft.style_weights.agt = (0.0, 0.0, 0.0)", "not all zero"),
    ("c.sft.style_weights = {'math': (1.0, 1.0, 1.0)}", "unknown domains ['math']"),
    ("c.sft.weight_decay = -0.1", "sft.weight_decay"),
    ("c.mopd.staleness = 1; c.mopd.is_bounds = (1.5, 2.0)", "mopd.is_bounds"),
    ("c.mopd.staleness = 1; c.mopd.loss = 'topk'", "needs mopd.loss='mopd'"),
    ("c.rl.reference = 'teacher'", "rl.reference"),
    ("c.mopd.teacher_temperature = 0.0", "mopd.teacher_temperature"),
    ("c.rl.loss = 'grpo'", "needs rl.loss='pmd'"),  # the toy's high and low hold pi_SFT
    ("c.rl.reference = 'sampler,sft'", "one per effort"),
    ("c.rl.reference = 'phase'", "rl.reference"),
    ("c.rl.anneal_tau_kl = -1.0", "tau_kl > 0"),
    ("c.rl.lane_processes = 0", "rl.lane_processes"),
    ("c.mopd.prompts_across_efforts = 'paired'", "mopd.prompts_across_efforts"),
    ("c.mopd.prompts_across_efforts = 'distinct'; c.mopd.effort_mix = (1.0, -1.0, 1.0)",
     "mopd.effort_mix"),
    ("c.mopd.effort_mix = (1.0, 1.0, 2.0)", "needs mopd.prompts_across_efforts='distinct'"),
]


@pytest.mark.parametrize("change, match", CASES)
def test_bad_config_raises_under_python_O(change, match):
  code = ("from configs import toy\nfrom mopd_jax import pipeline\n"
          f"c = toy.get_config('fast')\n{change}\n"
          "try:\n  pipeline.validate_config(c, 1)\nexcept ValueError as e:\n"
          "  print('ValueError:', e)\nelse:\n  print('no error')\n")
  out = subprocess.run([sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
  assert "ValueError:" in out.stdout and match in out.stdout, out.stdout + out.stderr


def test_unknown_key_and_wrong_type_are_rejected():
  from configs import toy
  c = toy.get_config("fast")
  c.lock()
  with pytest.raises(AttributeError):
    c.sft.stepz = 3
  with pytest.raises(TypeError):
    c.sft.steps = "many"


def test_batch_not_divisible_by_data_axis():
  from configs import toy
  from mopd_jax import pipeline
  c = toy.get_config("fast")
  c.mesh.data = 2
  with pytest.raises(ValueError, match="multiple of the data x fsdp"):
    pipeline.validate_config(c, 2)
