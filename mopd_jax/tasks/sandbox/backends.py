"""The sandbox's backends: how one program is started, confined, timed and judged.

`backend=` is "bwrap", "inprocess", or None (bwrap where it works, see `resolve_backend`):
 * ``bwrap`` (bubblewrap, a Debian package; the security boundary): new PID, IPC, UTS, network
   and cgroup namespaces (and a user namespace when not root), no network, a read-only view of
   the interpreter and standard library only (no /etc, /home or workdir), a size-capped private
   tmpfs as the only writable place and the working directory, an empty environment,
   ``--die-with-parent`` and ``--new-session``; the harness then sets hard rlimits (address
   space, CPU, processes, file size, open files, no core) and, when started as root, drops to
   ``nobody`` (root ignores RLIMIT_NPROC). Killing bwrap at the wall-clock limit tears down the
   PID namespace, and with it every process the program started. Standard-library imports,
   classes and helper functions are allowed.
 * ``inprocess`` (fallback where bubblewrap is missing, e.g. macOS; NOT a security boundary, and
   it warns loudly): ``python -I -S`` in a fresh temp dir (always deleted) in a new session,
   the same rlimits and privilege drop, ``unshare --net`` where permitted, spawn/kill/priority
   functions deleted from os/posix/_signal/_thread and the module re-creation functions from
   _imp, an irremovable audit hook refusing every event except compile/exec and ``open``
   inside the temp dir (or read-only in the stdlib), so no import after start-up; plus a
   static ``ast`` check (no imports, classes, ``with``, dunder or frame-walking names and
   attributes, including those of ``match`` class patterns).
"""
from __future__ import annotations

import functools
import hmac
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings

from .protocol import (_EXIT_DONE, _EXIT_MEMORY, _EXIT_SETUP, _EXIT_WRONG, _NEUTER, IOTests,
                       Limits, SandboxResult, _digest, _harness_source)

_NOBODY = 65534
_DROP_PRIVILEGES = True  # tests flip this to exercise the other barriers alone
BACKENDS = ("bwrap", "inprocess")


@functools.lru_cache(maxsize=None)
def _netns_prefix() -> tuple[str, ...]:
  """('unshare', '--net', '--') if that works here (root or CAP_SYS_ADMIN), else ()."""
  exe = shutil.which("unshare")
  if exe is None:
    return ()
  try:
    probe = subprocess.run([exe, "--net", "--", sys.executable, "-I", "-S", "-c", ""],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return ()
  return (exe, "--net", "--") if probe.returncode == 0 else ()


def _interpreter() -> str:
  return os.path.realpath(sys.executable)


def _bwrap_argv(job_dir: str, limits: Limits) -> list:
  """bubblewrap's command line: namespaces, the read-only interpreter, the tmpfs."""
  exe = shutil.which("bwrap")
  root = os.geteuid() == 0
  argv = [exe, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid",
          "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
  if root:  # keep only what the harness needs to drop to nobody, which clears them
    argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
  else:
    argv += ["--unshare-user"]
  ro = ["/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache",
        sys.base_prefix, os.path.dirname(os.path.dirname(_interpreter()))]
  seen = set()
  for path in ro:
    if os.path.exists(path) and path not in seen:
      seen.add(path)
      # Traversable parents (bwrap would copy a private parent's mode, e.g. /root's 0700).
      parent, parents = os.path.dirname(path), []
      while parent not in ("/", ""):
        parents.insert(0, parent)
        parent = os.path.dirname(parent)
      for d in parents:
        if d not in seen:
          seen.add(d)
          argv += ["--perms", "0755", "--dir", d]
      argv += ["--ro-bind", path, path]
  argv += ["--proc", "/proc", "--dev", "/dev",
           "--perms", "1777", "--size", str(limits.tmpfs_mb << 20), "--tmpfs", "/tmp",
           "--ro-bind", job_dir, "/job", "--chdir", "/tmp", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LC_ALL", "C.UTF-8", "--"]
  return argv


@functools.lru_cache(maxsize=None)
def bwrap_available() -> bool:
  """Whether bubblewrap is installed and can start a sandbox here (probed once)."""
  if shutil.which("bwrap") is None:
    return False
  job_dir = tempfile.mkdtemp(prefix="mopd_sbx_probe_")
  try:
    probe = subprocess.run([*_bwrap_argv(job_dir, Limits()), _interpreter(), "-I", "-S", "-c",
                            "open('/tmp/x', 'w').write('x')"],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=20)
    return probe.returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False
  finally:
    shutil.rmtree(job_dir, ignore_errors=True)


_WARNED = []


def resolve_backend(backend: str | None = None) -> str:
  """`backend` checked, or the best one here: bwrap where it works, else inprocess (with a
  loud warning, once: it is not a security boundary)."""
  if backend is not None:
    if backend not in BACKENDS:
      raise ValueError("sandbox backend must be one of %s, got %r" % (BACKENDS, backend))
    if backend == "bwrap" and not bwrap_available():
      raise ValueError("sandbox backend 'bwrap' is not usable here: install bubblewrap "
                       "(apt-get install bubblewrap) and allow user namespaces or run as root")
    return backend
  if bwrap_available():
    return "bwrap"
  if not _WARNED:
    _WARNED.append(True)
    msg = ("bubblewrap (bwrap) is not usable here: model-written code runs behind the "
           "in-process barrier, which is NOT a security boundary. Install bubblewrap "
           "(apt-get install bubblewrap) before running untrusted code at scale.")
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
    print("WARNING: " + msg, file=sys.stderr, flush=True)
  return "inprocess"


def _run_unchecked(source, tests, inputs, *, expected, limits, backend):
  n = len(inputs) if inputs is not None else tests.num_tests
  nonce, salt = os.urandom(32), os.urandom(16)
  drop = _DROP_PRIVILEGES and os.geteuid() == 0
  cpu = max(1, math.ceil(limits.timeout_s))
  box = backend == "bwrap"
  # inprocess: the temp dir is the program's cwd; bwrap: it holds the job, bound read-only,
  # and the program's cwd is the sandbox's own tmpfs.
  tmp = os.path.realpath(tempfile.mkdtemp(prefix="mopd_sbx_"))
  proc, start, read_fd, write_fd = None, time.monotonic(), None, None
  try:
    job = dict(source=source, tmp="/tmp" if box else tmp, uid=_NOBODY if drop else None,
               neuter=list(_NEUTER), inprocess=not box, proof_fd=None,
               limits=dict(RLIMIT_AS=[limits.memory_mb << 20] * 2, RLIMIT_CPU=[cpu, cpu + 1],
                           RLIMIT_NPROC=[limits.processes] * 2,
                           RLIMIT_FSIZE=[limits.file_mb << 20] * 2,
                           RLIMIT_NOFILE=[limits.open_files] * 2, RLIMIT_CORE=[0, 0]))
    if isinstance(tests, IOTests):
      blob = bytes(a ^ b for a, b in zip(nonce, _digest(salt, expected)))
      job.update(kind="io", func=tests.func, inputs=inputs, salt=salt.hex(), blob=blob.hex())
    else:
      job.update(kind="program", test=tests.code, entry_point=tests.entry_point,
                 nonce=nonce.hex())
    if box:  # the proof comes back through a pipe: nothing in the sandbox is kept
      read_fd, write_fd = os.pipe()
      os.set_blocking(read_fd, False)
      job["proof_fd"] = write_fd
    with open(os.path.join(tmp, "job.json"), "w") as fh:
      json.dump(job, fh)
    with open(os.path.join(tmp, "harness.py"), "w") as fh:
      fh.write(_harness_source())
    if drop and not box:  # inprocess: nobody writes `proof` here (bwrap: the harness reads
      os.chown(tmp, _NOBODY, _NOBODY)  # the job before it drops to nobody)
    if box:
      argv = [*_bwrap_argv(tmp, limits), _interpreter(), "-I", "-S", "/job/harness.py",
              "/job/job.json"]
    else:
      argv = [*_netns_prefix(), sys.executable, "-I", "-S", "harness.py", "job.json"]
    with open(os.path.join(tmp, "stderr.txt"), "wb") as err:
      proc = subprocess.Popen(
          argv, cwd=tmp, env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"},
          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
          start_new_session=True, close_fds=True,
          pass_fds=(write_fd,) if write_fd is not None else ())
    if write_fd is not None:
      os.close(write_fd)
      write_fd = None
    start = time.monotonic()
    # Wait without reaping (WNOWAIT) so the pid, hence the process-group id, cannot be
    # recycled before the whole group (stragglers included) is SIGKILLed below.
    timed_out, deadline = False, start + limits.timeout_s
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
      if time.monotonic() >= deadline:
        timed_out = True
        break
      time.sleep(0.005)
    _kill_group(proc.pid)
    rc = proc.wait()
    elapsed = time.monotonic() - start
    if timed_out:
      return SandboxResult(False, n, "timeout", "exceeded %.3gs" % limits.timeout_s, elapsed)
    if rc == _EXIT_DONE:
      if read_fd is not None:
        try:
          proof = os.read(read_fd, 200).strip()
        except OSError:
          proof = b""
      else:
        proof = _read_small(os.path.join(tmp, "proof"), 200).strip()
      if hmac.compare_digest(proof, nonce.hex().encode()):
        return SandboxResult(True, n, "ok", "all %d tests passed" % n, elapsed)
      return SandboxResult(False, n, "wrong", "wrong output", elapsed)
    if rc == _EXIT_WRONG:
      return SandboxResult(False, n, "wrong", "a test assertion failed", elapsed)
    if rc == _EXIT_MEMORY:
      return SandboxResult(False, n, "memory", "over %d MB" % limits.memory_mb, elapsed)
    return SandboxResult(False, n, "crash", _describe(rc, tmp), elapsed)
  finally:
    if proc is not None and proc.returncode is None:  # e.g. KeyboardInterrupt
      _kill_group(proc.pid)
      proc.wait()
    for fd in (read_fd, write_fd):
      if fd is not None:
        os.close(fd)
    shutil.rmtree(tmp, ignore_errors=True)


def _read_small(path: str, limit: int, tail: bool = False) -> bytes:
  """At most `limit` bytes of a file the child may have tampered with: a FIFO would
  block a plain open() forever and a symlink could point anywhere, so neither is read."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
  except OSError:
    return b""
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return b""
    if tail:
      os.lseek(fd, max(0, st.st_size - limit), os.SEEK_SET)
    return os.read(fd, limit)
  except OSError:
    return b""
  finally:
    os.close(fd)


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except OSError:  # already gone
    pass


def _describe(rc: int, tmp: str) -> str:
  if rc < 0:
    try:
      return "killed by %s" % signal.Signals(-rc).name
    except ValueError:
      return "killed by signal %d" % -rc
  if rc == _EXIT_SETUP:
    return "sandbox setup failed (exit %d)" % rc
  tail = _read_small(os.path.join(tmp, "stderr.txt"), 200, tail=True)
  tail = tail.decode("ascii", "replace").strip().splitlines()
  last = "".join(c for c in (tail[-1] if tail else "") if c.isprintable())[:100]
  return "exit status %d%s" % (rc, ": " + last if last else "")
