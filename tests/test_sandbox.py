"""Tests for the code sandbox (mopd_jax/tasks/sandbox/): the in-process barrier, then the
hostile suite against both barriers (bubblewrap where it works here, and in-process).

Hostile programs are written as oracles where possible: they return the correct answer
only if the attack succeeded, so reward 0 proves the barrier held (not just that the
program crashed for some unrelated reason). Variants with ``static_check=False`` skip the
AST pre-check so the runtime barriers are what is exercised; ``no_drop`` additionally
keeps the child as the current user, so the audit hook and rlimits stand alone.
"""
import functools
import os
import socket
import tempfile
import time

import pytest

from mopd_jax.tasks import sandbox
from mopd_jax.tasks.sandbox import backends, protocol

# The in-process barrier's own tests; the hostile suite at the end runs against both.
run_program = functools.partial(sandbox.run_program, backend="inprocess")
reward = functools.partial(sandbox.reward, backend="inprocess")

TESTS = [(1, 3), (2, 5), ((10,), 21)]
GOOD = "def f(x):\n    return x * 2 + 1\n"
RET = "    return x * 2 + 1\n"  # hostile programs end with this: they pass iff the attack worked
TIMEOUT = 1.0
SLACK = 2.5  # process start-up and kill on a busy 2-core machine


def _hostile(source, *, static_check=False, tests=TESTS, statuses=None, **kw):
  t0 = time.monotonic()
  res = run_program(source, tests, timeout_s=TIMEOUT, static_check=static_check, **kw)
  assert time.monotonic() - t0 < TIMEOUT + SLACK, res
  assert not res.passed and res.status != "ok", res
  if not static_check:
    assert res.status != "refused", res  # the runtime barrier, not the AST check, held
  if statuses is not None:
    assert res.status in statuses, res
  return res


@pytest.fixture(params=["drop", "no_drop"])
def privileges(request, monkeypatch):
  """Runs a test with and without the root -> nobody privilege drop."""
  monkeypatch.setattr(backends, "_DROP_PRIVILEGES", request.param == "drop")
  return request.param


# --- honest programs ---------------------------------------------------------------------
def test_correct_program_gets_reward_one():
  res = run_program(GOOD, TESTS)
  assert res.passed and res.status == "ok" and res.num_tests == 3, res
  assert reward(GOOD, TESTS) == 1.0


def test_multi_arg_and_structured_values():
  src = "def g(a, b):\n    return [a + b, str(a) * 2, {'k': (a, b)}, a / 1]\n"
  tests = [((1, 2), [3, "11", {"k": [1, 2]}, 1]), ((0, 5), [5, "00", {"k": (0, 5)}, 0.0])]
  assert reward(src, tests, func_name="g") == 1.0
  # A list is one argument, not *args.
  assert reward("def f(xs):\n    return sum(xs)\n", [([1, 2, 3], 6)]) == 1.0
  # Builtin-shadowing parameter names are fine.
  src = "def f(input, type):\n    return [input * 2, str(type)]\n"
  assert reward(src, [((3, 4), [6, "4"])]) == 1.0


def test_wrong_program_gets_zero():
  res = run_program("def f(x):\n    return x * 2\n", TESTS)
  assert res.status == "wrong" and reward("def f(x):\n    return x * 2\n", TESTS) == 0.0
  # One wrong test out of three is still 0: no partial credit.
  assert reward("def f(x):\n    return 21 if x == 10 else x * 2 + 1 if x == 1 else 0\n",
                        TESTS) == 0.0
  # Type-strict comparison: True is not 1, and a lying __eq__ never reaches a comparison.
  assert reward("def f(x):\n    return True\n", [(0, 1)]) == 0.0
  liar = "class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return A()\n"
  _hostile(liar, statuses={"crash"})


def test_syntax_error_and_missing_function():
  assert run_program("def f(x) return x", TESTS).status == "refused"
  assert run_program("def f(x) return x", TESTS, static_check=False).status == "crash"
  assert reward("def g(x):\n    return 1\n", TESTS) == 0.0
  assert run_program("x = 1\n", TESTS, static_check=False).status == "crash"
  for junk in ("", "   ", "\x00", "(" * 5000, "-" * 19_000 + "1", "x" * 30_000, None):
    assert reward(junk, TESTS) == 0.0


def test_memory_limit_leaves_room_for_honest_programs():
  src = "def f(x):\n    b = bytearray(50 * 2 ** 20)\n    return x * 2 + 1 + b[0]\n"
  assert reward(src, TESTS) == 1.0


# --- static check ------------------------------------------------------------------------
@pytest.mark.parametrize("src", [
    "import os\ndef f(x):\n    return 1",
    "from os import system\ndef f(x):\n    return 1",
    "def f(x):\n    return ().__class__.__bases__[0].__subclasses__()",
    "def f(x):\n    return getattr((), '_' + '_class_' + '_')",
    "def f(x):\n    g = getattr\n    return g(x, 'real')",
    "def f(x):\n    return '{0.__class__}'.format(x)",
    "def f(x):\n    return '{0.gi_frame}'.format((i for i in []))",
    "def f(x):\n    return (i for i in []).gi_frame.f_back",
    "def f(x):\n    return eval('x')",
    "def f(x):\n    return open('/etc/passwd').read()",
    "def f(x):\n    return __import__('os')",
    "def f(x):\n    return __builtins__",
    "def f(x):\n    return x._private",
    "class A:\n    pass\ndef f(x):\n    return 1",
    "def f(x):\n    return vars(x)",
    "def f(x, __y=1):\n    return 1",
])
def test_static_check_rejects(src):
  res = run_program(src, TESTS)
  assert res.status == "refused" and not res.passed, res


# --- hostile programs: every one must earn 0 within the timeout ----------------------------
@pytest.mark.parametrize("static_check", [True, False])
def test_infinite_loop_times_out(static_check):
  _hostile("def f(x):\n    while True:\n        pass\n", static_check=static_check,
           statuses={"timeout", "crash"})


@pytest.mark.parametrize("src", [
    "import os\ndef f(x):\n    while True:\n        os.fork()\n",
    "import os\ndef f(x):\n    for _ in range(50):\n        if os.fork() == 0:\n"
    "            os._exit(0)\n    return x * 2 + 1\n",
    "import posix\ndef f(x):\n    if posix.fork() == 0:\n        posix._exit(0)\n" + RET,
    "import multiprocessing\ndef f(x):\n    p = multiprocessing.Process(target=print)\n"
    "    p.start()\n    p.join()\n    return x * 2 + 1\n",
    "import subprocess\ndef f(x):\n    subprocess.run(['true'], check=True)\n" + RET,
    "import os\ndef f(x):\n    return x * 2 + 1 if os.system('true') == 0 else 0\n",
    "import os\ndef f(x):\n    os.posix_spawn('/bin/true', ['true'], {})\n    return x * 2 + 1\n",
    "import _thread\ndef f(x):\n    _thread.start_new_thread(print, ())\n    return x * 2 + 1\n",
])
def test_no_fork_or_subprocess(src, privileges):
  _hostile(src)


@pytest.mark.parametrize("src", [
    "def f(x):\n    b = bytearray(10 ** 10)\n    return x * 2 + 1\n",
    "def f(x):\n    b = [0] * 10 ** 10\n    return x * 2 + 1\n",
    "def f(x):\n    b = []\n    while True:\n        b.append(' ' * 10 ** 6)\n",
])
def test_huge_allocation_fails(src):
  _hostile(src, static_check=True)  # passes the AST check: only RLIMIT_AS stops it
  _hostile(src, memory_mb=128)


def test_reading_system_files_fails(privileges, tmp_path):
  secret = tmp_path / "secret.txt"
  secret.write_text("top secret")
  for path, content in (("/etc/passwd", open("/etc/passwd").read()),
                        (str(secret), "top secret")):
    _hostile(f"def f(x):\n    return open({path!r}).read()\n", tests=[(0, content)])
    _hostile(f"import os\ndef f(x):\n    return os.read(os.open({path!r}, os.O_RDONLY), 10**6)"
             f".decode()\n", tests=[(0, content)])


def test_hidden_expected_outputs_are_not_readable():
  marker = "SECRET-7d1f0c"
  src = ("def f(x):\n    for name in ('job.json', 'harness.py'):\n"
         "        text = open(name).read()\n"
         f"        if {marker[:6]!r} in text:\n"
         f"            i = text.index({marker[:6]!r})\n"
         "            return text[i:i + 13]\n    return ''\n")
  _hostile(src, tests=[(0, marker)], statuses={"wrong"})


def test_network_is_blocked(privileges):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(8)
  port = server.getsockname()[1]
  try:
    for src in (
        f"import socket\ndef f(x):\n    s = socket.create_connection(('127.0.0.1', {port}))\n"
        "    return x * 2 + 1\n",
        f"import _socket\ndef f(x):\n    s = _socket.socket()\n"
        f"    s.connect(('127.0.0.1', {port}))\n" + RET,
        "import socket\ndef f(x):\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    return x * 2 + 1\n"):
      _hostile(src)
    server.settimeout(0.2)
    with pytest.raises(socket.timeout):  # nobody ever connected
      server.accept()
  finally:
    server.close()


def _strip_hook(monkeypatch):
  """Harness without the audit hook and the function deletion: only rlimits (+netns) remain."""
  harness = protocol._harness_source()
  stripped = harness.replace("sys.addaudithook(_hook)", "pass").replace(
      'for name in job["neuter"]', "for name in ()")
  assert stripped.count("pass") > harness.count("pass") and "job[\"neuter\"]" not in stripped
  monkeypatch.setattr(backends, "_harness_source", lambda: stripped)


def _strip_audit_hook_only(monkeypatch):
  """Harness without the audit hook (imports work) but with the deleted functions."""
  harness = protocol._harness_source()
  stripped = harness.replace("sys.addaudithook(_hook)", "pass")
  assert stripped != harness
  monkeypatch.setattr(backends, "_harness_source", lambda: stripped)


@pytest.mark.parametrize("src", [
    # A fresh posix module from _imp would bring the deleted functions back.
    "import _imp, sys\ndef f(x):\n    p = _imp.create_builtin(sys.modules['posix'].__spec__)\n"
    "    p.kill(PARENT, 0)\n" + RET,
    "import os\ndef f(x):\n    os.setpriority(os.PRIO_PROCESS, PARENT, 19)\n" + RET,
    "import os\ndef f(x):\n    os.sched_setaffinity(PARENT, {0})\n" + RET,
    "import os, signal\ndef f(x):\n    signal.pidfd_send_signal(os.pidfd_open(PARENT), 0)\n"
    + RET,
    "import os\ndef f(x):\n    os.nice(5)\n" + RET,
])
def test_deleted_functions_stay_deleted_without_the_audit_hook(src, monkeypatch):
  """The in-process barrier's holes: re-creating posix through _imp, and re-nicing,
  pinning or signalling the parent (not audited), each closed by the deletion alone."""
  _strip_audit_hook_only(monkeypatch)
  monkeypatch.setattr(backends, "_DROP_PRIVILEGES", False)  # a non-root child's view
  nice, affinity = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)
  _hostile(src.replace("PARENT", str(os.getpid())))
  assert (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)) == (nice, affinity)
  # The same harness runs an honest program.
  assert reward(GOOD, TESTS) == 1.0


def test_network_namespace_when_available(monkeypatch):
  if not backends._netns_prefix():
    pytest.skip("unshare --net is not permitted here")
  _strip_hook(monkeypatch)
  monkeypatch.setattr(backends, "_DROP_PRIVILEGES", False)  # so `import socket` can load
  with socket.create_server(("127.0.0.1", 0)) as server:
    port = server.getsockname()[1]
    src = f"import socket\ndef f(x):\n    socket.create_connection(('127.0.0.1', {port}))\n"
    res = _hostile(src + RET)
    assert "raised" in res.detail, res  # it got to run and try
    server.settimeout(0.2)
    with pytest.raises(socket.timeout):
      server.accept()


@pytest.mark.parametrize("src", [
    "import os\ndef f(x):\n    os.kill(os.getppid(), 9)\n    return x * 2 + 1\n",
    "import os\ndef f(x):\n    os.killpg(os.getpgid(os.getppid()), 9)\n    return x * 2 + 1\n",
    "import os\ndef f(x):\n    os.killpg(0, 9)\n    return x * 2 + 1\n",
    "import os, signal\ndef f(x):\n    signal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)\n"
    "    return x * 2 + 1\n",
])
def test_cannot_kill_parent_or_group(src, privileges):
  _hostile(src)
  assert os.getpid() > 0  # still here


@pytest.mark.parametrize("src,static_check", [
    ("def f(x):\n    print('PASSED')\n    print('ALL TESTS PASSED')\n    raise SystemExit(0)\n",
     True),
    ("import sys\nprint('ALL TESTS PASSED')\nsys.exit(0)\ndef f(x):\n    return 0\n", False),
    ("import os\ndef f(x):\n    print('3 passed')\n    os._exit(0)\n", False),
    ("import os\ndef f(x):\n    os._exit(%d)\n" % protocol._EXIT_DONE, False),
    ("import os\ndef f(x):\n    open('proof', 'w').write('ab' * 32)\n    os._exit(%d)\n"
     % protocol._EXIT_DONE, False),
    ("import os\ndef f(x):\n    os.mkfifo('proof')\n    os._exit(%d)\n" % protocol._EXIT_DONE,
     False),
    ("import sys\ndef f(x):\n    h = sys.modules['__main__']\n"
     "    h._digest = lambda s, v: bytes(32)\n"
     "    return 0\n", False),
])
def test_fake_success_earns_nothing(src, static_check):
  _hostile(src, static_check=static_check)


def test_writing_outside_temp_dir_fails(privileges, tmp_path):
  target = tmp_path / "pwned.txt"
  for src in (
      f"def f(x):\n    open({str(target)!r}, 'w').write('x')\n    return x * 2 + 1\n",
      f"import os\ndef f(x):\n    os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n"
      "    return x * 2 + 1\n",
      f"import os\ndef f(x):\n    d = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
      "    os.open('pwned.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)\n    return x * 2 + 1\n",
      "def f(x):\n    open('../pwned.txt', 'w').write('x')\n    return x * 2 + 1\n",
      "import os\ndef f(x):\n    os.symlink('/', 'root')\n    return x * 2 + 1\n"):
    _hostile(src)
  assert not target.exists()


@pytest.mark.parametrize("src,static_check", [
    ("def f(x):\n    return f(x + 1)\n", True),
    ("import sys\nsys.setrecursionlimit(10 ** 7)\ndef f(x):\n    return f(x + 1)\n", False),
])
def test_deep_recursion(src, static_check):
  _hostile(src, static_check=static_check)


def test_subclass_walk_bypassing_ast_check(privileges):
  src = ("def f(x):\n    for c in ().__class__.__bases__[0].__subclasses__():\n"
         "        if c.__name__ == '_wrap_close':\n"
         "            g = c.__init__.__globals__\n"
         "            return x * 2 + 1 if g['system']('true') == 0 else 0\n")
  assert run_program(src, TESTS).status == "refused"
  _hostile(src)


def test_temp_dirs_are_removed(monkeypatch, tmp_path):
  root = tmp_path / "sbx_root"
  root.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(root))
  assert reward(GOOD, TESTS) == 1.0
  _hostile("def f(x):\n    open('junk.txt', 'w').write('x')\n    while True:\n        pass\n")
  _hostile("import os\ndef f(x):\n    os.chmod('.', 0)\n    return x * 2 + 1\n")
  _hostile("def f(x):\n    open('big.txt', 'w').write('x' * (4 << 20))\n    return x * 2 + 1\n")
  assert os.listdir(root) == []


def test_runtime_limits_alone_stop_fork_and_memory(monkeypatch):
  # Root ignores RLIMIT_NPROC: when run as root this relies on the drop to `nobody`.
  _strip_hook(monkeypatch)
  assert reward(GOOD, TESTS) == 1.0
  _hostile("import os\ndef f(x):\n    if os.fork() == 0:\n        os._exit(0)\n" + RET)
  _hostile("def f(x):\n    b = bytearray(10 ** 10)\n    return x * 2 + 1\n")
  # A FIFO named `proof` must not hang the parent when it reads the proof.
  _hostile("import os\ndef f(x):\n    os.mkfifo('proof')\n    os._exit(%d)\n" % protocol._EXIT_DONE,
           statuses={"wrong"})
  _hostile("def f(x):\n    while True:\n        pass\n", statuses={"timeout", "crash"})


# --- API -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(timeout_s=0), dict(timeout_s=-1.0), dict(memory_mb=0), dict(func_name="not valid"),
    dict(func_name="__import__"), dict(tests=[]), dict(tests=[(1, object())]),
    dict(tests=[(1,)]), dict(tests="abc"),
])
def test_bad_caller_arguments_raise(kwargs):
  kwargs = dict(dict(tests=TESTS), **kwargs)
  with pytest.raises(ValueError):
    run_program(GOOD, **kwargs)


def test_extract_program():
  fmt = sandbox.RESPONSE_FORMAT
  assert sandbox.extract_program(fmt) == "def f(x):\n    return x + 1"
  text = ("I think <code>x</code> is wrong.\nFinal:\n<code>\n```python\n"
          "def f(x):\n    return x * 2 + 1\n```\n</code>\n")
  assert sandbox.extract_program(text) == "def f(x):\n    return x * 2 + 1"
  assert reward(sandbox.extract_program(text), TESTS) == 1.0
  assert sandbox.extract_program("no code here") is None
  assert sandbox.extract_program("<code>\n  \n</code>") is None
  assert sandbox.extract_program("<code>def f(x): return 1") is None  # unterminated
  assert sandbox.extract_program(None) is None


# --- the hostile suite, against both barriers ----------------------------------------------
# Programs may import (the bubblewrap backend allows it; the in-process barrier refuses the
# import at run time, static check off). Each must end with reward 0 within its time limit,
# leaving no process and no file behind.
BACKENDS = [pytest.param("bwrap", marks=pytest.mark.skipif(
    not sandbox.bwrap_available(), reason="bubblewrap is not usable here")), "inprocess"]
MARK = "mopd-sbx-hostile-7f3a"
SECRET_ENV = "MOPD_SBX_SECRET"


def _leftovers() -> list:
  """Live processes whose command line carries MARK."""
  found = []
  for pid in os.listdir("/proc"):
    if pid.isdigit():
      try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
          if MARK.encode() in fh.read():
            found.append(int(pid))
      except OSError:
        pass
  return found


def _spawner(cmd: str) -> str:
  """A detached child that would outlive the sandbox, carrying MARK in its command line."""
  return (f"import os, subprocess, sys\ndef f(x):\n"
          f"    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {MARK}'],"
          f" start_new_session=True)\n    {cmd}\n" + RET)


HOSTILE = {
    "fork bomb": "import os\ndef f(x):\n    while True:\n        os.fork()\n",
    "thread bomb": "import threading, time\ndef f(x):\n    while True:\n"
                   "        threading.Thread(target=time.sleep, args=(60,)).start()\n",
    "detached child": _spawner("pass"),
    "memory bomb": "def f(x):\n    b = [bytearray(10 ** 7) for _ in range(10 ** 4)]\n" + RET,
    "output flood": "import sys\ndef f(x):\n    while True:\n"
                    "        sys.stdout.write('x' * 65536)\n        sys.stderr.write('y' * 65536)\n",
    "file flood": "def f(x):\n    for i in range(10 ** 6):\n"
                  "        open(f'junk{i}.txt', 'w').write('z' * 4096)\n" + RET,
    "sleep forever": "import time\ndef f(x):\n    time.sleep(10 ** 6)\n",
    "write outside": f"def f(x):\n    open('/var/tmp/{MARK}.txt', 'w').write('x')\n"
                     f"    open('/tmp/{MARK}.txt', 'w').write('x')\n" + RET,
    "parent env": f"import os\ndef f(x):\n    v = os.environ.get({SECRET_ENV!r}) or "
                  f"open('/proc/%d/environ' % os.getppid()).read()\n"
                  f"    return x * 2 + 1 if 'hunter2' in v else 0\n",
    "socket": "import socket\ndef f(x):\n    socket.create_connection(('127.0.0.1', PORT), 1)\n"
              + RET,
    "signal parent": "import os, signal\ndef f(x):\n    os.kill(PARENT, signal.SIGSTOP)\n"
                     "    os.kill(os.getppid(), signal.SIGKILL)\n" + RET,
    "pidfd parent": "import os, signal\ndef f(x):\n"
                    "    signal.pidfd_send_signal(os.pidfd_open(PARENT), signal.SIGSTOP)\n" + RET,
    "renice parent": "import os\ndef f(x):\n    os.setpriority(os.PRIO_PROCESS, PARENT, 19)\n"
                     "    os.sched_setaffinity(PARENT, {0})\n" + RET,
    "forge exit": "import os\ndef f(x):\n    os._exit(%d)\n" % protocol._EXIT_DONE,
    "forge proof": "import os\ndef f(x):\n    for fd in range(3, 64):\n        try:\n"
                   "            os.write(fd, b'ab' * 32)\n        except OSError:\n"
                   "            pass\n    open('proof', 'w').write('ab' * 32)\n"
                   "    os._exit(%d)\n" % protocol._EXIT_DONE,
    "forge digest": "import sys\ndef f(x):\n    sys.modules['__main__']._digest = "
                    "lambda s, v: bytes(32)\n    return 0\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("backend", BACKENDS)
def test_hostile_programs_earn_nothing_and_leave_nothing(name, backend, monkeypatch, tmp_path):
  root = tmp_path / "sbx_root"
  root.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(root))
  monkeypatch.setenv(SECRET_ENV, "hunter2")
  nice, affinity = os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)
  with socket.create_server(("127.0.0.1", 0)) as server:
    src = HOSTILE[name].replace("PORT", str(server.getsockname()[1])).replace(
        "PARENT", str(os.getpid()))
    t0 = time.monotonic()
    res = sandbox.run(src, sandbox.IOTests("f", tuple(TESTS)),
                      sandbox.Limits(timeout_s=TIMEOUT), backend=backend, static_check=False)
    assert time.monotonic() - t0 < TIMEOUT + SLACK, res
    assert not res.passed and res.status != "refused", res
    server.settimeout(0.05)
    with pytest.raises(socket.timeout):  # nobody connected
      server.accept()
  assert (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)) == (nice, affinity)
  time.sleep(0.05)
  assert not _leftovers(), (name, res)
  assert os.listdir(root) == [], res
  assert not os.path.exists(f"/var/tmp/{MARK}.txt") and not os.path.exists(f"/tmp/{MARK}.txt")


@pytest.mark.parametrize("backend", BACKENDS)
def test_program_tests_mbpp_and_humaneval_conventions(backend):
  limits = sandbox.Limits(timeout_s=5.0)
  # Imports, classes and helpers are allowed under bubblewrap (refused in-process).
  src = ("import math\nclass Acc:\n    def __init__(self):\n        self.n = 0\n"
         "def helper(x):\n    return math.isqrt(x)\ndef root_sum(xs):\n"
         "    return sum(helper(x) for x in xs)\n")
  mbpp = sandbox.ProgramTests("assert root_sum([4, 9]) == 5\nassert root_sum([]) == 0\n", "", 2)
  human = sandbox.ProgramTests("def check(candidate):\n    assert candidate([16]) == 4\n",
                               "root_sum")
  wrong = sandbox.ProgramTests("assert root_sum([4]) == 3\n")
  want = "ok" if backend == "bwrap" else "refused"
  assert sandbox.run(src, mbpp, limits, backend=backend).status == want
  assert sandbox.run(src, human, limits, backend=backend).status == want
  if backend == "bwrap":
    assert sandbox.run(src, wrong, limits, backend=backend).status == "wrong"
  plain = "def root_sum(xs):\n    return sum(int(x ** 0.5) for x in xs)\n"
  assert sandbox.run(plain, mbpp, limits, backend=backend).passed
  assert sandbox.run(plain, wrong, limits, backend=backend).status == "wrong"
  exits = "import sys\ndef root_sum(xs):\n    sys.exit(0)\n"  # an early exit is no pass
  assert sandbox.run(exits, mbpp, limits, backend=backend, static_check=False).status == "crash"


def test_static_check_refuses_match_class_attributes():
  src = ("def f(x):\n    match f:\n        case object(__globals__=g):\n"
         "            return g\n    return 0\n")
  assert sandbox.check_source(src) == "forbidden attribute __globals__"


def test_fallback_warns_loudly(monkeypatch):
  monkeypatch.setattr(backends, "bwrap_available", lambda: False)
  monkeypatch.setattr(backends, "_WARNED", [])
  with pytest.warns(RuntimeWarning, match="NOT a security boundary"):
    assert sandbox.resolve_backend() == "inprocess"
  with pytest.raises(ValueError, match="bubblewrap"):
    sandbox.resolve_backend("bwrap")


def test_bwrap_as_an_ordinary_user(tmp_path):
  """The bubblewrap backend as `nobody` (a user namespace instead of root's privilege
  drop), with the system interpreter (the sandbox module is stdlib only)."""
  if os.geteuid() != 0 or not sandbox.bwrap_available():
    pytest.skip("needs root to switch to nobody, and bubblewrap")
  import shutil
  import subprocess
  import sys
  py = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
  code = ("import importlib.util, sys\n"
          f"spec = importlib.util.spec_from_file_location('sbx', {sandbox.__file__!r})\n"
          "m = importlib.util.module_from_spec(spec); sys.modules['sbx'] = m\n"
          "spec.loader.exec_module(m)\n"
          "ok = m.run_program('import math\\ndef f(x):\\n    return x * 2 + 1\\n', [(1, 3)],"
          " backend='bwrap')\n"
          "bomb = m.run_program('import os\\ndef f(x):\\n    while True:\\n        os.fork()\\n',"
          " [(1, 3)], backend='bwrap')\n"
          "print(ok.status, bomb.status)\n")
  res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py,
                        "-I", "-c", code], cwd="/", capture_output=True, text=True, timeout=60,
                       env={"PATH": os.defpath, "TMPDIR": "/tmp"})
  if res.returncode != 0 and "Permission denied" in res.stderr:
    pytest.skip("nobody cannot read this interpreter or module: " + res.stderr[-200:])
  assert res.stdout.split() == ["ok", "crash"], res.stdout + res.stderr


def test_run_many_keeps_order_and_bounds_the_pool():
  jobs = [("def f(x):\n    return x * 2 + 1\n" if i % 2 else "def f(x):\n    return 0\n",
           sandbox.IOTests("f", tuple(TESTS))) for i in range(6)]
  out = sandbox.run_many(jobs, workers=2)
  assert [r.passed for r in out] == [False, True] * 3
  with pytest.raises(ValueError, match="workers"):
    sandbox.run_many(jobs, workers=0)
