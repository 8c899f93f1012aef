"""`config.profile`: the step range of the chosen loop is traced, nothing else is.
(The switch inside a real stage run is exercised by colabs/01_quickstart.ipynb, which
profiles its SFT loop and asserts that the trace file exists.)"""
import os

import jax
import jax.numpy as jnp
import pytest

from configs import toy
from mopd_jax.io import profiling
from mopd_jax.stages.loops import Progress


@pytest.fixture
def profile_cfg():
  return toy.get_config("fast").profile


def _trace_files(root):
  return [f for _, _, fs in os.walk(root) for f in fs if f.endswith(".xplane.pb")]


def test_traces_the_configured_step_range(tmp_path, profile_cfg):
  profile_cfg.stage, profile_cfg.start_step, profile_cfg.num_steps = "sft", 1, 2
  switch = profiling.Switch(profile_cfg, str(tmp_path))
  assert Progress("rl gen/max", 4, switch=switch).profiler is None  # another loop
  bar = Progress("sft", 4, switch=switch)
  f = jax.jit(lambda x: x @ x)
  running = []
  for _ in range(4):
    running.append(bar.profiler.running)  # while the step runs
    f(jnp.ones((8, 8))).block_until_ready()
    bar.update({"loss": 1.0})
  bar.close()
  assert running == [False, True, True, False]
  assert _trace_files(tmp_path / "profile" / "sft")
  assert Progress("sft", 4, switch=switch).profiler is None  # one traced range per run
  assert Progress("sft", 4).profiler is None  # no switch: no profiler


def test_off_by_default_and_stage_names(tmp_path, profile_cfg):
  switch = profiling.Switch(profile_cfg, str(tmp_path))
  assert switch.spec is None
  assert Progress("sft", 2, switch=switch).profiler is None
  assert profiling.matches("rl", "rl gen/high") and profiling.matches("rl gen", "rl gen/high")
  assert profiling.matches("mopd", "mopd")
  assert not profiling.matches("mopd", "mopd init: teacher SFT")
  assert not profiling.matches("sft", "mopd init: teacher SFT")


@pytest.mark.parametrize("field,value", [("stage", "train"), ("start_step", -1),
                                         ("num_steps", 0)])
def test_bad_switch_is_an_error(tmp_path, profile_cfg, field, value):
  profile_cfg.stage = "sft"
  setattr(profile_cfg, field, value)
  with pytest.raises(ValueError, match="profile"):
    profiling.Switch(profile_cfg, str(tmp_path))


def test_compile_clock_counts_this_process_compilations():
  """A new program adds its compile seconds and one XLA compilation; running it again adds
  neither."""
  import jax
  import jax.numpy as jnp
  from mopd_jax.io import profiling
  import time
  salt = float(time.time_ns() % 1_000_003)  # a program no cache holds
  f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + salt)
  x = jnp.ones((7, 5)).block_until_ready()
  s0, n0 = profiling.CompileClock.read()
  f(x).block_until_ready()
  s1, n1 = profiling.CompileClock.read()
  assert s1 > s0 and n1 == n0 + 1
  f(x).block_until_ready()
  assert profiling.CompileClock.read() == (s1, n1)
