"""The code sandbox: model-written Python run against tests, for every code verifier.

One entry point, `run(source, tests, limits, backend)`, returns a `SandboxResult`: passed or
not, with the reason as its status: ok, wrong (an output or assertion wrong), timeout, memory,
crash (an exception, a signal or an early exit), refused (no program, or the static check of
the in-process barrier). `run_many` runs many programs on a bounded thread pool (each program
is its own process tree). `run_program` is the toy `cod` domain's call: hidden
``(args, expected)`` pairs for one function.

Tests. `IOTests(func, pairs)`: the function's outputs on the inputs are checked against
expected outputs the child never sees (below). `ProgramTests(code, entry_point)`: a test
program (MBPP's asserts, or HumanEval's `check(candidate)`, called with the function named
`entry_point`) run after the candidate in the same namespace.

Pass protocol. The verdict is the harness's exit status plus a proof, never stdout (which goes
to /dev/null). For IOTests the parent draws a random 32-byte nonce N and a salt and gives the
child only the inputs and ``blob = N xor sha256(salt || canonical_json(expected outputs))``; the
harness writes ``blob xor sha256(salt || canonical_json(actual outputs))`` as its proof and
exits with status 73 (``_EXIT_DONE``). The parent passes the program only if the status is 73
*and* the proof is N, which holds only if every output was right: without the expected outputs
a program cannot produce N, whatever it does to the harness. Outputs are compared type-strictly
after canonicalisation (tuples -> lists, integral floats -> int, only plain JSON types, so a
user-defined ``__eq__`` is never consulted). For ProgramTests the expected values are in the
test program the child runs, so the proof is N itself, written only after the tests ran:
exiting early, printing "passed" or writing a made-up proof earns nothing, but a program that
deliberately reads the harness's memory for N can forge a pass. The sandbox still contains
such a program; it is a limit of visible tests, not of the isolation.

Backends (`backend=` "bwrap", "inprocess", or None = bwrap where it works):
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

import ast
import concurrent.futures
import dataclasses
import functools
import hashlib
import hmac
import inspect
import json
import math
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from typing import Any, Sequence

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
# What a response looks like; the task generator shows this to the policy.
RESPONSE_FORMAT = ("<free-text reasoning>\n" + CODE_OPEN + "\ndef f(x):\n    return x + 1\n"
                   + CODE_CLOSE)
MAX_SOURCE_CHARS = 20_000
STATUSES = ("ok", "wrong", "timeout", "memory", "crash", "refused")

_EXIT_DONE, _EXIT_RAISED, _EXIT_SETUP, _EXIT_MEMORY, _EXIT_WRONG = 73, 74, 75, 76, 77
_NOBODY = 65534
_DROP_PRIVILEGES = True  # tests flip this to exercise the other barriers alone


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  passed: bool
  num_tests: int
  status: str  # one of STATUSES
  detail: str = ""
  elapsed_s: float = 0.0


def extract_program(response_text: str) -> str | None:
  """Source inside the last ``<code>...</code>`` block, or None."""
  if not isinstance(response_text, str):
    return None
  pattern = re.escape(CODE_OPEN) + r"(.*?)" + re.escape(CODE_CLOSE)
  blocks = re.findall(pattern, response_text, flags=re.DOTALL)
  if not blocks:
    return None
  # Tolerate a markdown fence inside the tags.
  body = re.sub(r"^\s*```[a-zA-Z]*[ \t]*\n|\n```\s*$", "", blocks[-1].strip("\n"))
  body = textwrap.dedent(body).strip("\n")
  return body if body.strip() else None


# --- shared with the child: their source is shipped verbatim into the harness.
def _canon(v):
  """Plain JSON-able copy of v; TypeError for anything else (custom objects)."""
  t = type(v)
  if v is None or t is bool or t is int or t is str:
    return v
  if t is float:
    return int(v) if v.is_integer() else v
  if t is list or t is tuple:
    return [_canon(x) for x in v]
  if t is dict and all(type(k) is str for k in v):
    return {k: _canon(x) for k, x in v.items()}
  raise TypeError("unsupported value type %s" % t.__name__)


def _digest(salt, values):
  blob = json.dumps(values, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(salt + blob.encode("utf-8")).digest()


_HARNESS = r'''
import hashlib, json, os, resource, sys
%(shared)s
with open(sys.argv[1], "rb") as fh:
  job = json.loads(fh.read())
TMP, STDLIB = job["tmp"], os.path.dirname(os.__file__)
try:  # limits first, hard ones too; then shed root (root ignores RLIMIT_NPROC)
  os.chdir(TMP)  # before the drop: nobody may not traverse TMP's parents
  for name, (soft, hard) in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
  if job["uid"] is not None:
    os.setgroups([])
    os.setresgid(job["uid"], job["uid"], job["uid"])
    os.setresuid(job["uid"], job["uid"], job["uid"])
  PROOF_FD = job["proof_fd"]
  if job["inprocess"]:
    for mod in (os, sys.modules["posix"], sys.modules["_signal"], sys.modules["_thread"]):
      for name in job["neuter"]:
        vars(mod).pop(name, None)
    for name in ("create_builtin", "exec_builtin", "create_dynamic", "exec_dynamic",
                 "init_frozen", "get_frozen_object"):  # no fresh copy of posix
      vars(sys.modules["_imp"]).pop(name, None)
except BaseException:
  os._exit(%(setup)d)

WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def _under(p, root):
  return p == root or p.startswith(root + os.sep)
def _hook(event, args):  # fail closed: anything unexpected raises
  if event in ("compile", "exec", "builtins.id"):
    return
  if event == "open":
    path, mode, flags = args
    if type(path) is int:  # an already-open fd (only 0-2 are inherited)
      return
    if type(path) is bytes:
      path = os.fsdecode(path)
    if type(path) is str:  # exact type: a PathLike could answer differently later
      full = os.path.normpath(os.path.join(TMP, path))
      if _under(full, TMP):
        return
      # mode is None for os.open, whose dir_fd could re-root a relative path.
      if mode is not None and not flags & WRITE and _under(full, STDLIB):
        return
  raise PermissionError("sandbox refused " + event)
if job["inprocess"]:
  sys.addaudithook(_hook)

def _prove(proof):
  if PROOF_FD is None:
    with open("proof", "wb") as fh:
      fh.write(proof.hex().encode())
  else:
    os.write(PROOF_FD, proof.hex().encode())

try:
  ns = {"__name__": "candidate"}
  exec(compile(job["source"], "<candidate>", "exec"), ns)
  if job["kind"] == "io":
    fn = ns[job["func"]]
    outs = [_canon(fn(*args)) for args in job["inputs"]]
    key = _digest(bytes.fromhex(job["salt"]), outs)
    proof = bytes(a ^ b for a, b in zip(bytes.fromhex(job["blob"]), key))
  else:
    tns = dict(ns, __name__="tests")
    try:
      exec(compile(job["test"], "<tests>", "exec"), tns)
      if job["entry_point"]:
        tns["check"](ns[job["entry_point"]])
    except AssertionError:
      os._exit(%(wrong)d)
    proof = bytes.fromhex(job["nonce"])
except MemoryError:
  os._exit(%(memory)d)
except BaseException as e:  # includes SystemExit raised by the program
  try:
    sys.stderr.write("program raised %%s\n" %% type(e).__name__[:60])
  except BaseException:
    pass
  os._exit(%(raised)d)
_prove(proof)
os._exit(%(done)d)
'''
# Deleted from os/posix/_signal/_thread before the program runs (inprocess backend). Not
# audited in 3.11: pidfd_* (kill the parent), start_new_thread, mkfifo/mknod (a FIFO `proof`
# could hang a naive reader), and the priority / affinity setters (re-nice or pin the parent).
_NEUTER = ("system", "fork", "forkpty", "kill", "killpg", "pidfd_open", "posix_spawn",
           "posix_spawnp", "execv", "execve", "pthread_kill", "pidfd_send_signal", "setsid",
           "setpgid", "start_new_thread", "start_new", "mkfifo", "mknod", "setpriority",
           "sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_param",
           "nice", "setpgrp", "register_at_fork")


def _harness_source() -> str:
  shared = inspect.getsource(_canon) + "\n" + inspect.getsource(_digest)
  return _HARNESS % dict(shared=shared, setup=_EXIT_SETUP, raised=_EXIT_RAISED, done=_EXIT_DONE,
                         memory=_EXIT_MEMORY, wrong=_EXIT_WRONG)


# --- static pre-check ----------------------------------------------------------------------
# Any use of these names, not just calls (`g = getattr`); harmless builtins that are common
# parameter names (type, input, dir) stay allowed.
_BANNED_NAMES = frozenset({
    "open", "exec", "eval", "compile", "__import__", "getattr", "setattr", "delattr", "globals",
    "locals", "vars", "breakpoint", "memoryview", "super", "object", "classmethod",
    "staticmethod", "property"})
# str.format can walk attributes ("{0.gi_frame}"); the rest lead to frames and their globals.
_BANNED_ATTRS = frozenset({
    "format", "format_map", "mro", "gi_frame", "gi_code", "cr_frame", "ag_frame", "f_back",
    "f_globals", "f_locals", "f_builtins", "f_code", "tb_frame", "tb_next"})
_BANNED_NODES = (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal, ast.ClassDef, ast.With,
                 ast.AsyncWith, ast.AsyncFunctionDef, ast.AsyncFor, ast.Await)


def check_source(source: str, func_name: str | None = "f") -> str | None:
  """Reason to reject ``source`` without running it, or None if it may run."""
  if len(source) > MAX_SOURCE_CHARS:
    return "program too long"
  try:
    tree = ast.parse(source)
  except Exception as e:  # SyntaxError; ValueError (NUL); Memory/RecursionError
    return "syntax error: %s" % type(e).__name__
  for node in ast.walk(tree):
    if isinstance(node, _BANNED_NODES):
      return "forbidden statement %s" % type(node).__name__
    if isinstance(node, ast.Attribute) and (node.attr[:1] == "_" or node.attr in _BANNED_ATTRS):
      return "forbidden attribute %s" % node.attr
    if isinstance(node, ast.MatchClass):  # `case C(__globals__=g)` reads an attribute
      for attr in node.kwd_attrs:
        if attr[:1] == "_" or attr in _BANNED_ATTRS:
          return "forbidden attribute %s" % attr
    name = getattr(node, "id", None) or getattr(node, "arg", None) or getattr(node, "name", None)
    if isinstance(name, str) and (name[:2] == "__" or name in _BANNED_NAMES):
      return "forbidden name %s" % name
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
      if ("__" if isinstance(node.value, str) else b"__") in node.value:  # getattr-free tricks
        return "forbidden string constant"
  if func_name and not any(isinstance(n, ast.FunctionDef) and n.name == func_name
                           for n in tree.body):
    return "no top-level function %s" % func_name
  return None


# --- running -----------------------------------------------------------------------------
BACKENDS = ("bwrap", "inprocess")


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-program limits. `processes`: RLIMIT_NPROC of the program's user (1 = no fork);
  `file_mb`: largest file it may write; `tmpfs_mb`: its whole writable space (bwrap)."""
  timeout_s: float = 2.0
  memory_mb: int = 256
  processes: int = 1
  file_mb: int = 1
  open_files: int = 32
  tmpfs_mb: int = 16

  def __post_init__(self):
    if not (isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
            and 0 < self.timeout_s < 600):
      raise ValueError("timeout_s must be in (0, 600), got %r" % (self.timeout_s,))
    if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
      raise ValueError("memory_mb must be an int >= 64, got %r" % (self.memory_mb,))
    for name in ("processes", "file_mb", "open_files", "tmpfs_mb"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError("%s must be an int >= 1, got %r" % (name, v))


@dataclasses.dataclass(frozen=True)
class IOTests:
  """Hidden tests of one function: `pairs` of (args, expected); a tuple `args` is the
  positional arguments, anything else the single argument; plain JSON-like values."""
  func: str
  pairs: tuple

  def __post_init__(self):
    f = self.func
    if not (isinstance(f, str) and f.isidentifier() and f[:1] != "_"):
      raise ValueError("bad func_name %r" % (f,))


@dataclasses.dataclass(frozen=True)
class ProgramTests:
  """A test program run after the candidate in its namespace: asserts (MBPP), or a
  `check(candidate)` definition called with the function `entry_point` (HumanEval)."""
  code: str
  entry_point: str = ""
  num_tests: int = 1

  def __post_init__(self):
    if not isinstance(self.code, str) or not self.code.strip():
      raise ValueError("ProgramTests.code must be a non-empty string")
    if self.entry_point and not self.entry_point.isidentifier():
      raise ValueError("bad entry_point %r" % (self.entry_point,))


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


def normalise_tests(tests) -> tuple[list, list]:
  """(inputs, expected) of (args, expected) pairs as plain JSON-like values; ValueError
  for anything else (the form IOTests take)."""
  if not isinstance(tests, (list, tuple)) or not tests:
    raise ValueError("tests must be a non-empty list of (args, expected)")
  inputs, expected = [], []
  for item in tests:
    if not isinstance(item, (list, tuple)) or len(item) != 2:
      raise ValueError("each test must be an (args, expected) pair")
    args, exp = item
    args = list(args) if isinstance(args, tuple) else [args]  # tuple = *args
    try:
      inputs.append(_canon(args))
      expected.append(_canon(exp))
      json.dumps(expected[-1]), json.dumps(inputs[-1])
    except (TypeError, ValueError) as e:
      raise ValueError("test values must be plain JSON-like data: %s" % e)
  return inputs, expected


def run(source: str, tests, limits: Limits = Limits(), backend: str | None = None, *,
        static_check: bool | None = None) -> SandboxResult:
  """Runs `source` against `tests` (IOTests or ProgramTests) under `limits`; never raises on
  bad source. `backend`: "bwrap", "inprocess" or None (the best here, see resolve_backend).
  `static_check` (default: on for inprocess, off for bwrap, which allows imports and classes).

  Errors: ValueError only for bad arguments from the caller (tests, limits, backend)."""
  if not isinstance(tests, (IOTests, ProgramTests)):
    raise ValueError("tests must be IOTests or ProgramTests, got %r" % (type(tests).__name__,))
  if not isinstance(limits, Limits):
    raise ValueError("limits must be a sandbox.Limits")
  backend = resolve_backend(backend)
  if isinstance(tests, IOTests):
    inputs, expected = normalise_tests(tests.pairs)
    n = len(inputs)
  else:
    inputs = expected = None
    n = tests.num_tests
  if not isinstance(source, str) or not source.strip():
    return SandboxResult(False, n, "refused", "no program")
  if static_check is None:
    static_check = backend == "inprocess"
  if static_check:
    reason = check_source(source, tests.func if isinstance(tests, IOTests) else None)
    if reason is not None:
      return SandboxResult(False, n, "refused", reason)
  return _run_unchecked(source, tests, inputs, expected, limits, backend)


def run_many(jobs, limits: Limits = Limits(), backend: str | None = None, *,
             workers: int = 2) -> list:
  """`run` over `jobs` [(source, tests), ...] on a pool of `workers` threads (each program is
  its own process tree, so threads suffice); results in job order."""
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError("workers must be an int >= 1, got %r" % (workers,))
  backend = resolve_backend(backend)
  jobs = list(jobs)
  if workers == 1 or len(jobs) <= 1:
    return [run(src, t, limits, backend) for src, t in jobs]
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
    return list(pool.map(lambda job: run(job[0], job[1], limits, backend), jobs))


def run_program(source: str, tests: Sequence[tuple[Any, Any]], *, func_name: str = "f",
                timeout_s: float = 2.0, memory_mb: int = 256,
                static_check: bool | None = None, backend: str | None = None) -> SandboxResult:
  """The toy `cod` call: `source`'s `func_name` on hidden (args, expected) `tests` (see
  IOTests). Errors: ValueError only for bad arguments from the caller."""
  limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb)
  return run(source, IOTests(func_name, tuple(tests) if isinstance(tests, list) else tests),
             limits, backend, static_check=static_check)


def _run_unchecked(source, tests, inputs, expected, limits, backend):
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


def reward(source: str, tests: Sequence[tuple[Any, Any]], **kwargs) -> float:
  """1.0 if the program passes every test, else 0.0 (no partial credit)."""
  return 1.0 if run_program(source, tests, **kwargs).passed else 0.0
