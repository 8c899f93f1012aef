"""`cod`, coding: what affine function does a short program compute (code tracing)?

    prompt  a,b,c=4,7,2;a,b=b,a;b,c=c,b;a,c=c,a;a,b=b,a;a*x+b?
    full    (7,4,2);(7,2,4);(4,2,7);(2,4,7)\n#2*x+4     the state (a,b,c) after every line
    brief   (7,2,4)\n#2*x+4                             the state after the second line only
    direct  #2*x+4                                      the program only

Three variables get distinct digits 1-9, then four swap statements run; the answer is the
function `f(x) = a*x + b` of the final values, written canonically. Why full is easy: every
statement is 8 characters and every state is 8 characters, so each step reads the previous
state and its statement at the *same* relative offsets and just reorders three digits. Brief
composes two swaps at once; direct all four (swaps do not commute: no shortcut).
504 * 3^4 = 40824 distinct prompts. The hidden tests are eight x in [-10, 20].

The program. The answer after the last `#` is a Python *expression* in `x`: the verifier runs
`def f(x):\n    return (<expr>)` (it must parse as one expression). A response may instead hold
a `<code>...</code>` block with a whole function `f` (the sandbox's `RESPONSE_FORMAT`); the last
such block wins over any `#` answer. The generated styles use the expression form because a
full `<code>def f(x): ...</code>` block alone is ~35 tokens, too long for a low-effort budget.

Verification. Fast path, no exec: an expression (or a `<code>` body) that matches the strict
canonical grammar `A*x+B` / `A*x-B` (`A`, `B` decimal integers without leading zeros, no
spaces) is evaluated in-process with integer arithmetic. Anything else goes to
`sandbox.run_program` (one subprocess per call, ~50-100 ms); results other than timeouts are
cached by (program, tests). Reward is 1.0 iff every hidden test passes.
"""
from __future__ import annotations

import ast
import collections
import itertools
import json
import re

from mopd_jax.tasks import base
from mopd_jax.tasks import sandbox

MAX_EXPR_CHARS = 200
_NUM = r"(-?(?:0|[1-9]\d{0,5}))"
_CANON_EXPR = re.compile(_NUM + r"\*x([+-](?:0|[1-9]\d{0,5}))")
_CANON_CODE = re.compile(r"def f\(x\):\n[ \t]+return " + _NUM + r"\*x([+-](?:0|[1-9]\d{0,5}))\s*")


VARS = "abc"


def canonical_expr(a: int, b: int) -> str:
  return f"{a}*x{b:+d}"


def parse_canonical(program_or_expr: str, is_code: bool = False):
  """(a, b) if the text is exactly in the canonical grammar, else None. Never executes it."""
  m = (_CANON_CODE if is_code else _CANON_EXPR).fullmatch(program_or_expr)
  return (int(m.group(1)), int(m.group(2))) if m else None


def expr_program(expr: str) -> str | None:
  """`def f(x): return (expr)` if `expr` is a single short Python expression, else None."""
  if not expr or len(expr) > MAX_EXPR_CHARS or "\n" in expr:
    return None
  try:
    ast.parse(expr, mode="eval")
  except Exception:  # pylint: disable=broad-except  (SyntaxError, ValueError on NUL, ...)
    return None
  return f"def f(x):\n    return ({expr})\n"


class CodTask(base.Task):
  name = "cod"

  def __init__(self, num_hidden: int = 8, timeout_s: float = 2.0, memory_mb: int = 256,
               cache_size: int = 4096, num_swaps: int = 4):
    super().__init__()
    if not (1 <= num_hidden <= 31 and 1 <= num_swaps <= 8):
      raise ValueError("need 1 <= num_hidden <= 31 and 1 <= num_swaps <= 8")
    self.num_hidden, self.timeout_s, self.memory_mb = num_hidden, timeout_s, memory_mb
    self.num_swaps = num_swaps
    self.cache_size = cache_size
    self._cache = collections.OrderedDict()
    self.num_fast_path = 0
    self.num_sandbox_runs = 0
    self.num_cache_hits = 0

  def make(self, values, swaps, test_x, seed: int = 0, index: int = 0) -> base.Example:
    """The example for initial `values` of (a, b, c), `swaps` (pairs of variable indices,
    e.g. (0, 2) for `a,c=c,a`) and the hidden test inputs `test_x`."""
    state = [int(v) for v in values]
    if len(state) != 3 or not all(0 <= v <= 9 for v in state):
      raise ValueError(f"need three one-digit values, got {values}")
    lines, states = [], []
    for i, j in swaps:
      i, j = sorted((int(i), int(j)))
      if not 0 <= i < j <= 2:
        raise ValueError(f"bad swap {(i, j)}")
      u, v = VARS[i], VARS[j]
      lines.append(f"{u},{v}={v},{u}")
      state[i], state[j] = state[j], state[i]
      states.append("(" + ",".join(map(str, state)) + ")")
    a, b = state[0], state[1]
    expr = canonical_expr(a, b)
    prompt = "a,b,c=" + ",".join(str(int(v)) for v in values) + ";" + ";".join(lines) + \
        ";a*x+b?"
    full = ";".join(states) + "\n#" + expr
    mid = states[len(states) // 2 - 1] if len(states) >= 2 else states[0]
    solutions = dict(full=full, brief=f"{mid}\n#{expr}", direct=f"#{expr}")
    tests = [[int(t), a * int(t) + b] for t in test_x]
    return base.make_example(self.name, seed, index, prompt, expr, solutions,
                             dict(a=a, b=b, values=[int(v) for v in values],
                                  swaps=[list(map(int, p)) for p in swaps], tests=tests))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 3)
    pairs = [(0, 1), (0, 2), (1, 2)]
    for i in itertools.count():
      values = (rng.permutation(9)[:3] + 1).tolist()
      swaps = [pairs[int(rng.integers(0, 3))] for _ in range(self.num_swaps)]
      test_x = (rng.permutation(31)[:self.num_hidden] - 10).tolist()
      yield self.make(values, swaps, test_x, seed, i)

  # verification
  def program_of(self, response: str) -> tuple[str | None, tuple | None]:
    """(program source or None, canonical (a, b) or None) for a response."""
    if not isinstance(response, str):
      return None, None
    if sandbox.CODE_OPEN in response:
      source = sandbox.extract_program(response)
      if source is not None:
        return source, parse_canonical(source, is_code=True)
    expr = base.final_answer(response)
    if expr is None:
      return None, None
    return expr_program(expr), parse_canonical(expr)

  def _verify(self, example: base.Example, response: str) -> float:
    tests = example.meta["tests"]
    source, canon = self.program_of(response)
    if source is None:
      return 0.0
    if canon is not None:
      self.num_fast_path += 1
      a, b = canon
      return float(all(a * x + b == y for x, y in tests))
    key = (source, json.dumps(tests))
    if key in self._cache:
      self.num_cache_hits += 1
      self._cache.move_to_end(key)
      return self._cache[key]
    self.num_sandbox_runs += 1
    res = sandbox.run_program(source, [(x, y) for x, y in tests], func_name="f",
                              timeout_s=self.timeout_s, memory_mb=self.memory_mb)
    r = 1.0 if res.passed else 0.0
    if res.status != "timeout" and self.cache_size > 0:
      self._cache[key] = r
      if len(self._cache) > self.cache_size:
        self._cache.popitem(last=False)
    return r

  def counters(self) -> dict:
    return dict(super().counters(), fast_path=self.num_fast_path,
                sandbox_runs=self.num_sandbox_runs, cache_hits=self.num_cache_hits)
