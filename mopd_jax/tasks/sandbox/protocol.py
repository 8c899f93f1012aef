"""The sandbox's pass protocol (see the package docstring): results, limits, the two kinds of
tests, and the harness the child runs, which proves a pass with the nonce it can rebuild only
from the right outputs. Standard library only, like the whole package."""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json

MAX_SOURCE_CHARS = 20_000
STATUSES = ("ok", "wrong", "timeout", "memory", "crash", "refused")

_EXIT_DONE, _EXIT_RAISED, _EXIT_SETUP, _EXIT_MEMORY, _EXIT_WRONG = 73, 74, 75, 76, 77


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  passed: bool
  num_tests: int
  status: str  # one of STATUSES
  detail: str = ""
  elapsed_s: float = 0.0


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
