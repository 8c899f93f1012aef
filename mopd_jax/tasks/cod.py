"""`cod`, coding: synthesise `f(x) = a*x + b` from three input/output examples.

    prompt  f(0)=1,f(2)=7,f(5)=16
    full    a=(7-1)/(2-0)=6/2=3\\nb=1-3*0=1-0=1\\n#3*x+1    derive a and b step by step
    brief   a=3,b=1\\n#3*x+1                              the parameters only
    direct  #3*x+1                                       the program only

The examples in the prompt are sorted by x; a in [-5, 9] minus 0, b in [-9, 9], shown x in
[0, 9]. The hidden tests are the three shown points plus five unseen x in [-10, 20].

The program. The answer after the last `#` is a Python *expression* in `x`: the verifier runs
`def f(x):\\n    return (<expr>)` (it must parse as one expression). A response may instead hold
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

  def __init__(self, num_hidden: int = 5, timeout_s: float = 2.0, memory_mb: int = 256,
               cache_size: int = 4096):
    super().__init__()
    self.num_hidden, self.timeout_s, self.memory_mb = num_hidden, timeout_s, memory_mb
    self.cache_size = cache_size
    self._cache = collections.OrderedDict()
    self.num_fast_path = 0
    self.num_sandbox_runs = 0
    self.num_cache_hits = 0

  def make(self, a: int, b: int, shown_x, hidden_x, seed: int = 0,
           index: int = 0) -> base.Example:
    shown_x = sorted(int(v) for v in shown_x)
    ys = [a * v + b for v in shown_x]
    (x1, x2), (y1, y2) = shown_x[:2], ys[:2]
    expr = canonical_expr(a, b)
    full = (f"a=({y2}-{y1})/({x2}-{x1})={y2 - y1}/{x2 - x1}={a}\n"
            f"b={y1}-{a}*{x1}={y1}-{a * x1}={b}\n#{expr}")
    solutions = dict(full=full, brief=f"a={a},b={b}\n#{expr}", direct=f"#{expr}")
    prompt = ",".join(f"f({v})={y}" for v, y in zip(shown_x, ys))
    tests = [[v, a * v + b] for v in shown_x + [int(v) for v in hidden_x]]
    return base.make_example(self.name, seed, index, prompt, expr, solutions,
                             dict(a=a, b=b, tests=tests))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 3)
    a_values = [v for v in range(-5, 10) if v != 0]
    for i in itertools.count():
      a = a_values[int(rng.integers(0, len(a_values)))]
      b = int(rng.integers(-9, 10))
      shown = rng.choice(10, size=3, replace=False)
      pool = [v for v in range(-10, 21) if v not in set(shown.tolist())]
      hidden = [pool[j] for j in rng.choice(len(pool), size=self.num_hidden, replace=False)]
      yield self.make(a, b, shown, hidden, seed, i)

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
