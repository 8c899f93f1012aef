"""The host memory allocator of a run's processes: tcmalloc when the machine has it.

XLA's CPU runtime allocates each program's temporary buffer anew on every call (the toy's
train step: 70-200 MB). glibc's malloc serves any allocation above 32 MB with its own `mmap`
and unmaps it on `free`, so every step faults the whole buffer in again, page by page (the
toy's SFT stage: 9.7 million minor page faults in 300 updates, a fifth of its CPU time spent
in the kernel). tcmalloc keeps freed pages for the next call: the same 300 updates take 19%
less wall time, with 3 s of kernel time instead of 22 (docs/performance.md). Numbers do not
change: the allocator only decides where buffers live (the toy's parameters, histories and
eval cells are bitwise equal under either).

The library is loaded the only way an allocator can be swapped, before the process starts:
`reexec` replaces the entry point's process by the same command with `LD_PRELOAD` set, once,
and every process it spawns (the RL lanes, a sweep's runs) inherits it. `MOPD_ALLOCATOR`
chooses: `auto` (the default) uses tcmalloc when the dynamic loader finds it (Debian and
Ubuntu: `apt-get install libtcmalloc-minimal4`), `system` keeps glibc's malloc. Notebooks
and tests, which call `pipeline.run` in a process already started, keep the allocator they
started with; `describe()` says which it is.
"""
from __future__ import annotations

import ctypes.util
import os
import sys
from typing import Optional, Sequence

ENV = "MOPD_ALLOCATOR"
CHOICES = ("auto", "system")
_LIBRARIES = ("tcmalloc_minimal", "tcmalloc")  # gperftools' sonames, smallest first
HINT = ("install tcmalloc (Debian/Ubuntu: apt-get install libtcmalloc-minimal4) for a "
        "faster CPU run")


def choice(environ=None) -> str:
  """The `MOPD_ALLOCATOR` setting, checked."""
  value = (os.environ if environ is None else environ).get(ENV, "auto") or "auto"
  if value not in CHOICES:
    raise ValueError(f"{ENV}={value!r}; expected one of {', '.join(CHOICES)}")
  return value


def tcmalloc_library() -> Optional[str]:
  """The soname of a tcmalloc the dynamic loader can find, or None."""
  if not sys.platform.startswith("linux"):
    return None
  for name in _LIBRARIES:
    found = ctypes.util.find_library(name)
    if found:
      return found
  return None


def preloaded(environ=None) -> bool:
  """Whether this process's `LD_PRELOAD` names a tcmalloc."""
  return "tcmalloc" in (os.environ if environ is None else environ).get("LD_PRELOAD", "")


def loaded(maps: str = "/proc/self/maps") -> bool:
  """Whether a tcmalloc is mapped into this process (False where `maps` cannot be read)."""
  try:
    with open(maps) as f:  # local: the process's own memory map, never a workdir path
      return "tcmalloc" in f.read()
  except OSError:
    return False


def describe(environ=None) -> str:
  """One line naming the allocator this process runs with."""
  if loaded():
    return "host allocator: tcmalloc"
  if preloaded(environ):
    return "host allocator: the system malloc (LD_PRELOAD names a tcmalloc the loader did not load)"
  if choice(environ) == "system":
    return f"host allocator: the system malloc ({ENV}=system)"
  if tcmalloc_library() is None:
    return f"host allocator: the system malloc; {HINT}"
  return "host allocator: the system malloc (tcmalloc found, not preloaded in this process)"


def reexec(module: str, argv: Sequence[str], *, environ=None, execve=os.execve) -> None:
  """Replaces this process by `python -m module argv[1:]` with tcmalloc preloaded, when
  `MOPD_ALLOCATOR` is `auto`, the library is found and it is not loaded already; otherwise
  returns and the process goes on with the allocator it has. Call it first thing in an
  entry point, before any work (a bad `MOPD_ALLOCATOR` raises ValueError)."""
  env = dict(os.environ if environ is None else environ)
  if choice(env) == "system" or preloaded(env):
    return
  library = tcmalloc_library()
  if library is None:
    return
  env["LD_PRELOAD"] = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
  sys.stdout.flush()
  sys.stderr.flush()
  execve(sys.executable, [sys.executable, "-m", module, *argv[1:]], env)


if __name__ == "__main__":
  # `python -m mopd_jax.runtime.allocator`: the allocator an entry point of this machine runs with.
  reexec("mopd_jax.runtime.allocator", sys.argv)
  print(describe())
