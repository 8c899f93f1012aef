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

Modules: `protocol` (results, limits, tests and the harness's proof), `static_check` (the
in-process barrier's pre-check) and `backends` (bubblewrap, the security boundary, and the
in-process fallback; their isolation is described there). The package is standard library
only and imports its modules relatively, so it also loads on its own, outside mopd_jax
(tests/test_sandbox.py loads it that way as `nobody` with the system Python).
"""
from __future__ import annotations

import concurrent.futures
import re
import textwrap
from typing import Any, Sequence

from .backends import BACKENDS, _run_unchecked, bwrap_available, resolve_backend
from .protocol import (MAX_SOURCE_CHARS, STATUSES, IOTests, Limits, ProgramTests,
                       SandboxResult, normalise_tests)
from .static_check import check_source

__all__ = ["BACKENDS", "CODE_CLOSE", "CODE_OPEN", "IOTests", "Limits", "MAX_SOURCE_CHARS",
           "ProgramTests", "RESPONSE_FORMAT", "STATUSES", "SandboxResult", "bwrap_available",
           "check_source", "extract_program", "normalise_tests", "resolve_backend", "reward",
           "run", "run_many", "run_program"]

CODE_OPEN, CODE_CLOSE = "<code>", "</code>"
# What a response looks like; the task generator shows this to the policy.
RESPONSE_FORMAT = ("<free-text reasoning>\n" + CODE_OPEN + "\ndef f(x):\n    return x + 1\n"
                   + CODE_CLOSE)


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


def run(source: str, tests, limits: Limits = Limits(), *, backend: str | None = None,
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
  return _run_unchecked(source, tests, inputs, expected=expected, limits=limits, backend=backend)


def run_many(jobs, limits: Limits = Limits(), backend: str | None = None, *,
             workers: int = 2) -> list:
  """`run` over `jobs` [(source, tests), ...] on a pool of `workers` threads (each program is
  its own process tree, so threads suffice); results in job order."""
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError("workers must be an int >= 1, got %r" % (workers,))
  backend = resolve_backend(backend)
  jobs = list(jobs)
  if workers == 1 or len(jobs) <= 1:
    return [run(src, t, limits, backend=backend) for src, t in jobs]
  with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
    return list(pool.map(lambda job: run(job[0], job[1], limits, backend=backend), jobs))


def run_program(source: str, tests: Sequence[tuple[Any, Any]], *, func_name: str = "f",
                timeout_s: float = 2.0, memory_mb: int = 256,
                static_check: bool | None = None, backend: str | None = None) -> SandboxResult:
  """The toy `cod` call: `source`'s `func_name` on hidden (args, expected) `tests` (see
  IOTests). Errors: ValueError only for bad arguments from the caller."""
  limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb)
  return run(source, IOTests(func_name, tuple(tests) if isinstance(tests, list) else tests),
             limits, backend=backend, static_check=static_check)


def reward(source: str, tests: Sequence[tuple[Any, Any]], **kwargs) -> float:
  """1.0 if the program passes every test, else 0.0 (no partial credit)."""
  return 1.0 if run_program(source, tests, **kwargs).passed else 0.0
