"""Test setup, before JAX is imported: eight simulated CPU devices, LLVM at -O0
(`suite_cli.OPT_FLAG`: the suite is compile-bound), a shared compilation cache.

The persistent compilation cache is keyed by the compiled program, so it never changes a
result; it lets the many subprocesses of the suite (pipeline CLI runs, notebooks, multi-host
workers) reuse each other's compilations instead of repeating them.
"""
import fcntl
import importlib
import os
import shlex
import signal
import subprocess
import tempfile
import time

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


class SharedRun:
  """A process started by one pytest-xdist worker and waited on by any: its exit status goes
  to a file, so `poll`, `wait` and `returncode` work in every worker (as on a Popen)."""

  def __init__(self, command, workdir, env):
    self.workdir, self._rc = workdir, str(workdir) + ".rc"
    if not os.path.exists(str(workdir) + ".log"):  # the first worker here starts it
      quoted = " ".join(shlex.quote(str(a)) for a in command)
      rc = shlex.quote(self._rc)
      script = (f"{quoted} >> {shlex.quote(str(workdir) + '.log')} 2>&1; "
                f"echo $? > {rc}.tmp && mv {rc}.tmp {rc}")
      self._proc = subprocess.Popen(["sh", "-c", script], cwd=suite_cli.ROOT, env=env,
                                    start_new_session=True)
      open(str(workdir) + ".log", "a").close()
    else:
      self._proc = None
    self.started_here = self._proc is not None

  @property
  def returncode(self):
    return int(open(self._rc).read()) if os.path.exists(self._rc) else None

  def poll(self):
    return self.returncode

  def wait(self, timeout=None):
    deadline = time.time() + (timeout or 1e9)
    while self.returncode is None:
      if time.time() > deadline:
        raise subprocess.TimeoutExpired("tiny run", timeout)
      time.sleep(0.2)
    return self.returncode

  def kill(self):
    if self._proc is not None and self._proc.poll() is None:
      os.killpg(self._proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
  """One run of `suite_cli.TINY_CLI` for the whole test session, started in the background by
  the first test that asks for it, in whichever pytest-xdist worker: (run, workdir), `run`
  behaving as a Popen; its output goes to `<workdir>.log`. The pipeline and reliability tests
  read it or compare against it, so it runs once rather than once per worker."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent  # the session's folder, shared by its workers
  with open(root / "tiny_run.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    run = SharedRun([*suite_cli.TINY_CLI, "--workdir", str(root / "tiny_run")],
                    root / "tiny_run", suite_cli.env())
  yield run, root / "tiny_run"
  if run.started_here:  # its starter lets it finish: another worker may be waiting
    try:
      run.wait(timeout=900)
    finally:
      run.kill()


@pytest.fixture
def gcs(tmp_path, monkeypatch):
  """gs://... served from tmp_path/bucket_root (object storage without a network, for
  tests/test_storage.py and the data files of tests/test_records.py); returns that local
  root."""
  fsspec = pytest.importorskip("fsspec")
  from etils.epath import backend
  from fsspec.implementations.local import LocalFileSystem
  root = str(tmp_path / "bucket_root")
  os.makedirs(root)

  class LocalGCS(LocalFileSystem):
    protocol = ("gs", "gcs")

    def __init__(self, *args, **kwargs):
      kwargs.pop("finalize_on_close", None)
      super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
      path = os.fspath(path)
      for p in ("gs://", "gcs://"):
        if path.startswith(p):
          return os.path.join(root, path[len(p):].lstrip("/"))
      return path if path.startswith(root) else os.path.join(root, path.lstrip("/"))

  saved = {k: fsspec.registry.get(k) for k in ("gs", "gcs")}
  for proto in ("gs", "gcs"):
    fsspec.register_implementation(proto, LocalGCS, clobber=True)
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  monkeypatch.setattr(backend.tf_backend, "open", None, raising=False)  # never TF's gfile
  yield root
  backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  registry = importlib.import_module("fsspec.registry")._registry  # pylint: disable=protected-access
  for proto, impl in saved.items():  # as before the test
    if impl is None:
      registry.pop(proto, None)
    else:
      registry[proto] = impl
