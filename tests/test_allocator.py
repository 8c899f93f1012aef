"""The host allocator choice (mopd_jax/runtime/allocator.py): when an entry point restarts itself with
tcmalloc preloaded, and what it says of the allocator it runs with."""
import os
import subprocess
import sys

import pytest

from mopd_jax.runtime import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Exec:
  def __init__(self):
    self.calls = []

  def __call__(self, path, argv, env):
    self.calls.append((path, argv, env))


def test_reexec_preloads_tcmalloc_once_and_keeps_the_command(monkeypatch):
  monkeypatch.setattr(allocator, "tcmalloc_library", lambda: "libtcmalloc_minimal.so.4")
  ex = _Exec()
  allocator.reexec("experiments.run", ["/x/run.py", "--config", "c.py", "--workdir", "w"],
                   environ={"LD_PRELOAD": "libother.so", "KEEP": "1"}, execve=ex)
  (path, argv, env), = ex.calls
  assert path == sys.executable
  assert argv == [sys.executable, "-m", "experiments.run", "--config", "c.py", "--workdir", "w"]
  assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 libother.so" and env["KEEP"] == "1"
  # The restarted process has it preloaded: no second restart.
  ex2 = _Exec()
  allocator.reexec("experiments.run", argv[2:], environ=env, execve=ex2)
  assert not ex2.calls


@pytest.mark.parametrize("environ,library", [
    ({"MOPD_ALLOCATOR": "system"}, "libtcmalloc_minimal.so.4"),  # asked for glibc's
    ({}, None),  # no tcmalloc on the machine: go on with the system malloc
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, "libtcmalloc_minimal.so.4"),  # already
])
def test_reexec_leaves_the_process_alone(monkeypatch, environ, library):
  monkeypatch.setattr(allocator, "tcmalloc_library", lambda: library)
  ex = _Exec()
  allocator.reexec("experiments.run", ["run.py"], environ=environ, execve=ex)
  assert not ex.calls


def test_a_bad_setting_is_refused_by_name():
  with pytest.raises(ValueError, match="MOPD_ALLOCATOR='jemalloc'; expected one of auto, system"):
    allocator.reexec("experiments.run", ["run.py"], environ={"MOPD_ALLOCATOR": "jemalloc"},
                     execve=_Exec())


def test_describe_names_the_allocator_and_the_hint(monkeypatch, tmp_path):
  monkeypatch.setattr(allocator, "loaded", lambda: False)
  monkeypatch.setattr(allocator, "tcmalloc_library", lambda: None)
  assert "apt-get install libtcmalloc-minimal4" in allocator.describe({})
  assert "MOPD_ALLOCATOR=system" in allocator.describe({"MOPD_ALLOCATOR": "system"})
  assert "did not load" in allocator.describe({"LD_PRELOAD": "libtcmalloc.so.4"})
  monkeypatch.setattr(allocator, "loaded", lambda: True)
  assert allocator.describe({}) == "host allocator: tcmalloc"
  maps = tmp_path / "maps"
  maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libtcmalloc_minimal.so.4\n")
  monkeypatch.undo()
  assert allocator.loaded(str(maps)) and not allocator.loaded(str(tmp_path / "none"))


def test_the_entry_point_restarts_with_tcmalloc_where_the_machine_has_it():
  """The real restart (`python -m mopd_jax.runtime.allocator` restarts itself as an entry point
  does): with tcmalloc on the machine the restarted process has it mapped; a bad setting
  stops `experiments.run` with one config-error line before any work."""
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MOPD_ALLOCATOR")}
  out = subprocess.run([sys.executable, "-m", "mopd_jax.runtime.allocator"], env=env, cwd=ROOT,
                       check=True, capture_output=True, text=True).stdout.strip()
  if allocator.tcmalloc_library() is None:
    assert "apt-get install libtcmalloc-minimal4" in out
  else:
    assert out == "host allocator: tcmalloc"
  bad = subprocess.run([sys.executable, "-m", "experiments.run", "--config", "configs/toy.py"],
                       env={**env, "MOPD_ALLOCATOR": "nope"}, cwd=ROOT, capture_output=True,
                       text=True)
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
      "config error: MOPD_ALLOCATOR='nope'")
