"""How the suite starts processes: their XLA flags and environment, and the tiny toy run's
command.

The suite compiles with LLVM's optimisation off (`OPT_FLAG`): its programs are tiny, so a
test spends most of its time compiling, and -O0 roughly halves that. Runs, benchmarks and
notebooks outside the suite compile with XLA's defaults. `TINY_CLI` is the run shared by the
pipeline and reliability tests (the `tiny_run` fixture of conftest.py) and the command those
tests interrupt and resume, so every run they compare has the same configuration."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPT_FLAG = "--xla_backend_optimization_level=0"
TINY_CLI = (sys.executable, "-m", "experiments.run", "--config", "configs/toy.py:tiny",
            "--config.mopd.steps=3")


def xla_flags(devices: int | None = None) -> str:
  """`OPT_FLAG`, and `devices` simulated CPU devices if given."""
  return " ".join([OPT_FLAG] + ([f"--xla_force_host_platform_device_count={devices}"]
                                if devices else []))


def env(devices: int | None = None) -> dict:
  """A child process's environment: `xla_flags(devices)` (one CPU device by default: the
  configs' mesh, not conftest's eight), CPU only, and the suite's compilation cache with every
  program kept, so that a restarted or repeated run reuses what an earlier one compiled."""
  e = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  e.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return e
