"""Test setup, before JAX is imported: eight simulated CPU devices, a shared compilation cache.

The persistent compilation cache is keyed by the compiled program, so it never changes a
result; it lets the many subprocesses of the suite (pipeline CLI runs, notebooks, multi-host
workers) reuse each other's compilations instead of repeating them.
"""
import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), "mopd_jax_test_compile_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

SLOW = bool(os.environ.get("MOPD_SLOW_TESTS"))


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
