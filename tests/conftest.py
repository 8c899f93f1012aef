"""Test setup, before JAX is imported: eight simulated CPU devices, LLVM at -O0
(`suite_cli.OPT_FLAG`: the suite is compile-bound), a shared compilation cache.

The persistent compilation cache is keyed by the compiled program, so it never changes a
result; it lets the many subprocesses of the suite (pipeline CLI runs, notebooks, multi-host
workers) reuse each other's compilations instead of repeating them.
"""
import os
import subprocess
import tempfile

import suite_cli

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + suite_cli.xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "mopd_jax_test_compile_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

SLOW = bool(os.environ.get("MOPD_SLOW_TESTS"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """Under `-n N` (pytest-xdist) without an explicit `--dist`: `loadgroup`, so tests marked
  with the same `xdist_group` run on one worker (the users of the shared `tiny_run`)."""
  if getattr(config.option, "numprocesses", None) and config.option.dist == "no":
    config.option.dist = "loadgroup"


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "slow: a long end-to-end check outside the 15-minute CI budget; runs with "
      "MOPD_SLOW_TESTS=1 (what it covers is also covered by a faster test in the suite)")


def pytest_collection_modifyitems(config, items):
  if SLOW:
    return
  skip = pytest.mark.skip(reason="slow; set MOPD_SLOW_TESTS=1 to run it")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
  """One run of `suite_cli.TINY_CLI`, started in the background on first use: (process,
  workdir); its output goes to `<workdir>.log`. Tests that read it or compare against it (the
  pipeline and reliability tests) carry `pytest.mark.xdist_group("tiny_run")`, so under
  `-n 2` (`--dist loadgroup`, `pytest_cmdline_main` above) they share one worker and the run
  happens once."""
  wd = tmp_path_factory.mktemp("tiny") / "run"
  log = open(str(wd) + ".log", "a")
  proc = subprocess.Popen([*suite_cli.TINY_CLI, "--workdir", str(wd)], cwd=suite_cli.ROOT,
                          env=suite_cli.env(), stdout=log, stderr=subprocess.STDOUT)
  yield proc, wd
  if proc.poll() is None:
    proc.kill()
  log.close()
