"""`cod`, coding: synthesise `f(x) = a*x + b` from three input/output examples.

    prompt  f(2)=19,f(3)=25,f(7)=49
    full    a=25-19=6\nb=19-6*2=19-12=7\n#6*x+7    derive a and b step by step
    brief   a=6,b=7\n#6*x+7                        the parameters only
    direct  #6*x+7                                 the program only

The first two examples are at consecutive x = k, k+1 (so `a` is one subtraction, no division);
the third is at any other x. a in [1, 9], b in [0, 19], shown x in [0, 8] (every shown value
has at most two digits). Each full step is one table lookup with its operands written right
before it (a difference, a one-digit product, a difference); brief does the same steps without
writing the operands, and direct needs `b = f(k) - a*k` composed in one go, which the toy
model learns far more slowly. 8 * 7 * 9 * 20 = 10080 distinct prompts. The hidden tests are
the three shown points plus five unseen x in [-10, 20].

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
               cache_size: int = 4096, a_range=(1, 9), b_range=(0, 19), max_x: int = 8):
    super().__init__()
    if not (1 <= a_range[0] <= a_range[1] and 0 <= b_range[0] <= b_range[1] and max_x >= 2):
      raise ValueError("need 1 <= a_lo <= a_hi, 0 <= b_lo <= b_hi and max_x >= 2")
    self.num_hidden, self.timeout_s, self.memory_mb = num_hidden, timeout_s, memory_mb
    self.a_range, self.b_range, self.max_x = tuple(a_range), tuple(b_range), int(max_x)
    self.cache_size = cache_size
    self._cache = collections.OrderedDict()
    self.num_fast_path = 0
    self.num_sandbox_runs = 0
    self.num_cache_hits = 0

  def make(self, a: int, b: int, shown_x, hidden_x, seed: int = 0,
           index: int = 0) -> base.Example:
    """The example for `f(x) = a*x + b`; `shown_x[1]` must be `shown_x[0] + 1` (kept in order)."""
    a, b = int(a), int(b)
    shown_x = [int(v) for v in shown_x]
    if len(shown_x) < 2 or shown_x[1] != shown_x[0] + 1 or len(set(shown_x)) != len(shown_x):
      raise ValueError(f"shown x must be distinct and start with k, k+1; got {shown_x}")
    ys = [a * v + b for v in shown_x]
    k, (y1, y2) = shown_x[0], ys[:2]
    expr = canonical_expr(a, b)
    full = f"a={y2}-{y1}={a}\nb={y1}-{a}*{k}={y1}-{a * k}={b}\n#{expr}"
    solutions = dict(full=full, brief=f"a={a},b={b}\n#{expr}", direct=f"#{expr}")
    prompt = ",".join(f"f({v})={y}" for v, y in zip(shown_x, ys))
    tests = [[v, a * v + b] for v in shown_x + [int(v) for v in hidden_x]]
    return base.make_example(self.name, seed, index, prompt, expr, solutions,
                             dict(a=a, b=b, tests=tests))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 3)
    for i in itertools.count():
      a = int(rng.integers(self.a_range[0], self.a_range[1] + 1))
      b = int(rng.integers(self.b_range[0], self.b_range[1] + 1))
      k = int(rng.integers(0, self.max_x))  # k + 1 <= max_x
      third = [v for v in range(self.max_x + 1) if v not in (k, k + 1)]
      shown = [k, k + 1, third[int(rng.integers(0, len(third)))]]
      pool = [v for v in range(-10, 21) if v not in set(shown)]
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
