"""Sandboxed verifier for the ``cod`` (coding) toy-task domain. Pure stdlib, no JAX.

The policy answers in ``RESPONSE_FORMAT`` (last ``<code>...</code>`` block holds a small Python
function); ``run_program`` runs it against hidden ``(args, expected)`` tests in a throwaway
subprocess and ``reward`` maps that to 1.0 (every test passes) or 0.0 (no partial credit).

Pass protocol. The verdict is the harness's exit status plus a proof file, never stdout (which
goes to /dev/null). The child never sees the expected outputs: the parent draws a random 32-byte
nonce N and a salt and gives the child only the test inputs and
``blob = N xor sha256(salt || canonical_json(expected outputs))``. The harness runs the program,
writes ``blob xor sha256(salt || canonical_json(actual outputs))`` to ``proof`` and exits with
status 73 (``_EXIT_DONE``). The parent passes the program only if the status is 73 *and*
``proof == N``, which holds only if every output was right. The candidate shares the harness's
interpreter, so it can do anything the harness can (exit 0 or 73, write ``proof``, patch
``json``/``hashlib``, read job.json), but without the expected outputs it cannot produce N; and
unlike shipping per-test hashes, the blob gives no way to brute-force small answers offline.
Outputs are compared type-strictly after canonicalisation (tuples -> lists, integral floats ->
int, only plain JSON types, so a user-defined ``__eq__`` is never consulted).

Barriers (the static check is only a first line of defence; the runtime ones are the wall):
 * parent: ``ast`` check (no imports, classes, ``with``; no ``_``-prefixed attributes, dunder
   names, frame-walking attributes, ``'__'`` in strings, or any use of open/exec/eval/compile/
   getattr/...); wall-clock timeout, then SIGKILL of the child's whole process group (it runs
   in a new session); fresh temp dir as cwd, always deleted; minimal env; ``python -I -S``.
 * ``unshare --net`` (empty network namespace) where that works; probed once, not relied on.
 * harness, before any candidate code runs: hard rlimits AS=``memory_mb``, CPU, NPROC=1 (no
   fork, no threads), FSIZE=1 MiB, NOFILE=16, CORE=0; if started as root it then drops to
   ``nobody`` (root ignores NPROC; nobody cannot signal the parent or write its files); deletes
   spawn/kill/thread/mkfifo functions from os/posix/_signal/_thread (some are not audited);
   last, an irremovable ``sys.addaudithook`` hook refuses every audited event except
   compile/exec/builtins.id and ``open`` inside the temp dir (or read-only ``open`` in the
   stdlib). That refuses new imports (socket, ctypes, subprocess, multiprocessing, ...),
   os.system/fork/exec/spawn/kill, all other ``os.*`` file events and frame/traceback walking.
"""
from __future__ import annotations

import ast
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
from typing import Any, Sequence

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
# What a response looks like; the task generator shows this to the policy.
RESPONSE_FORMAT = ("<free-text reasoning>\n" + CODE_OPEN + "\ndef f(x):\n    return x + 1\n"
                   + CODE_CLOSE)
MAX_SOURCE_CHARS = 20_000
STATUSES = ("ok", "fail", "timeout", "error", "rejected")

_EXIT_DONE, _EXIT_RAISED, _EXIT_SETUP = 73, 74, 75  # harness exit statuses
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
with open("job.json", "rb") as fh:
  job = json.loads(fh.read())
TMP, STDLIB = job["tmp"], os.path.dirname(os.__file__)
try:  # limits first, hard ones too; then shed root (root ignores RLIMIT_NPROC)
  for name, (soft, hard) in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
  if job["uid"] is not None:
    os.setgroups([])
    os.setresgid(job["uid"], job["uid"], job["uid"])
    os.setresuid(job["uid"], job["uid"], job["uid"])
  for mod in (os, sys.modules["posix"], sys.modules["_signal"], sys.modules["_thread"]):
    for name in job["neuter"]:
      vars(mod).pop(name, None)
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
sys.addaudithook(_hook)

try:
  ns = {"__name__": "candidate"}
  exec(compile(job["source"], "<candidate>", "exec"), ns)
  fn = ns[job["func"]]
  outs = [_canon(fn(*args)) for args in job["inputs"]]
  key = _digest(bytes.fromhex(job["salt"]), outs)
except BaseException as e:  # includes SystemExit raised by the program
  try:
    sys.stderr.write("program raised %%s\n" %% type(e).__name__[:60])
  except BaseException:
    pass
  os._exit(%(raised)d)
proof = bytes(a ^ b for a, b in zip(bytes.fromhex(job["blob"]), key))
with open("proof", "wb") as fh:
  fh.write(proof.hex().encode())
os._exit(%(done)d)
'''
# Deleted from os/posix/_signal/_thread before the program runs. Not audited in 3.11: pidfd_*
# (kill the parent), start_new_thread, mkfifo/mknod (a FIFO `proof` could hang a naive reader).
_NEUTER = ("system", "fork", "forkpty", "kill", "killpg", "pidfd_open", "posix_spawn",
           "posix_spawnp", "execv", "execve", "pthread_kill", "pidfd_send_signal", "setsid",
           "setpgid", "start_new_thread", "start_new", "mkfifo", "mknod")


def _harness_source() -> str:
  shared = inspect.getsource(_canon) + "\n" + inspect.getsource(_digest)
  return _HARNESS % dict(shared=shared, setup=_EXIT_SETUP, raised=_EXIT_RAISED, done=_EXIT_DONE)


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


def check_source(source: str, func_name: str = "f") -> str | None:
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
    name = getattr(node, "id", None) or getattr(node, "arg", None) or getattr(node, "name", None)
    if isinstance(name, str) and (name[:2] == "__" or name in _BANNED_NAMES):
      return "forbidden name %s" % name
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
      if ("__" if isinstance(node.value, str) else b"__") in node.value:  # getattr-free tricks
        return "forbidden string constant"
  if not any(isinstance(n, ast.FunctionDef) and n.name == func_name for n in tree.body):
    return "no top-level function %s" % func_name
  return None


# --- running -----------------------------------------------------------------------------
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


def _normalise_tests(tests) -> tuple[list, list]:
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


def run_program(source: str, tests: Sequence[tuple[Any, Any]], *, func_name: str = "f",
                timeout_s: float = 2.0, memory_mb: int = 256,
                static_check: bool = True) -> SandboxResult:
  """Runs ``source``'s ``func_name`` on every test in a sandbox; never raises on bad source.

  Each test is ``(args, expected)``: a tuple ``args`` is the positional arguments, anything
  else is the single argument. Values must be plain JSON-like data (None/bool/int/float/str,
  lists/tuples, dicts with str keys). ValueError only for bad arguments from the caller.
  """
  if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < 600):
    raise ValueError("timeout_s must be in (0, 600), got %r" % (timeout_s,))
  if not (isinstance(memory_mb, int) and memory_mb >= 64):
    raise ValueError("memory_mb must be an int >= 64, got %r" % (memory_mb,))
  if not (isinstance(func_name, str) and func_name.isidentifier() and func_name[:1] != "_"):
    raise ValueError("bad func_name %r" % (func_name,))
  inputs, expected = _normalise_tests(tests)
  n = len(inputs)
  if not isinstance(source, str) or not source.strip():
    return SandboxResult(False, n, "rejected", "no program")
  if static_check:
    reason = check_source(source, func_name)
    if reason is not None:
      return SandboxResult(False, n, "rejected", reason)
  return _run_unchecked(source, inputs, expected, func_name, timeout_s, memory_mb)


def _run_unchecked(source, inputs, expected, func_name, timeout_s, memory_mb):
  n = len(inputs)
  nonce, salt = os.urandom(32), os.urandom(16)
  blob = bytes(a ^ b for a, b in zip(nonce, _digest(salt, expected)))
  drop = _DROP_PRIVILEGES and os.geteuid() == 0
  cpu = max(1, math.ceil(timeout_s))
  tmp = os.path.realpath(tempfile.mkdtemp(prefix="mopd_sbx_"))
  proc, start = None, time.monotonic()
  try:
    job = dict(source=source, func=func_name, inputs=inputs, tmp=tmp, salt=salt.hex(),
               blob=blob.hex(), uid=_NOBODY if drop else None, neuter=list(_NEUTER),
               limits=dict(RLIMIT_AS=[memory_mb << 20] * 2, RLIMIT_CPU=[cpu, cpu + 1],
                           RLIMIT_NPROC=[1, 1], RLIMIT_FSIZE=[1 << 20] * 2,
                           RLIMIT_NOFILE=[16, 16], RLIMIT_CORE=[0, 0]))
    with open(os.path.join(tmp, "job.json"), "w") as fh:
      json.dump(job, fh)
    with open(os.path.join(tmp, "harness.py"), "w") as fh:
      fh.write(_harness_source())
    if drop:  # the harness writes `proof` here after shedding root
      os.chown(tmp, _NOBODY, _NOBODY)
    with open(os.path.join(tmp, "stderr.txt"), "wb") as err:
      proc = subprocess.Popen(
          [*_netns_prefix(), sys.executable, "-I", "-S", "harness.py"],
          cwd=tmp, env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"},
          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
          start_new_session=True, close_fds=True)
    start = time.monotonic()
    # Wait without reaping (WNOWAIT) so the pid, hence the process-group id, cannot be
    # recycled before the whole group (stragglers included) is SIGKILLed below.
    timed_out, deadline = False, start + timeout_s
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
      if time.monotonic() >= deadline:
        timed_out = True
        break
      time.sleep(0.005)
    _kill_group(proc.pid)
    rc = proc.wait()
    elapsed = time.monotonic() - start
    if timed_out:
      return SandboxResult(False, n, "timeout", "exceeded %.3gs" % timeout_s, elapsed)
    if rc == _EXIT_DONE:
      proof = _read_small(os.path.join(tmp, "proof"), 200).strip()
      if hmac.compare_digest(proof, nonce.hex().encode()):
        return SandboxResult(True, n, "ok", "all %d tests passed" % n, elapsed)
      return SandboxResult(False, n, "fail", "wrong output", elapsed)
    return SandboxResult(False, n, "error", _describe(rc, tmp), elapsed)
  finally:
    if proc is not None and proc.returncode is None:  # e.g. KeyboardInterrupt
      _kill_group(proc.pid)
      proc.wait()
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
