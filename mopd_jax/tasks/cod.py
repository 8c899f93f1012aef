"""`cod`, coding: fold the constants of a one-line program into canonical form.

    prompt  210212%3*x+2011%3#b=1
    full    =200112%3*x+2200%3\n#2*x+0     the code again, every digit replaced by the value
                                          of its number's prefix mod 3
    brief   ~200112\n#2*x+0                folds the slope only; b is written unfolded (a
                                          model can only copy the comment, stale here)
    direct  #2*x+0                         the program only

Each style opens with its own mark (`=`, `~`, `#`), so the style is chosen at the first token.
Without the marks full and brief share their first seven tokens: a student distilled at high
effort wrote the slope's trace and then, as often as not, went on with full's `%3*x+...` and
ran over its budget (student cod/high 0.000 at 20 tokens against its teacher's 14;
docs/toy_history.md). Both traces carry a mark, so the trace digits stay at the same offset from their code
digits in both styles.

The program is `f(x) = A%3*x + B%3` for two decimal literals A (6 digits) and B (4 digits)
whose digits are 0-2 (so `A%3` is the digit sum mod 3); the trailing comment claims the
folded intercept and is stale (wrong) with probability `stale_prob`. The answer is
`f(x) = a*x + b` written canonically. Why full is easy: the trace is aligned character by
character with the code, so each step reads its digit and the previous value at the *same*
relative offsets and applies one 9-entry table. Brief folds A the same way but copies b from
the comment (right unless stale); direct has to fold A in its head (a count with wraps, no
shortcut). The hidden tests are eight x in [-10, 20].

The program. The answer after the last `#` is a Python *expression* in `x`: the verifier runs
`def f(x):\n    return (<expr>)` (it must parse as one expression). A response may instead hold
a `<code>...</code>` block with a whole function `f` (the sandbox's `RESPONSE_FORMAT`); the last
such block wins over any `#` answer. The generated styles use the expression form because a
full `<code>def f(x): ...</code>` block alone is ~35 tokens, too long for a low-effort budget.

Verification. Fast path, no exec: an expression (or a `<code>` body) that matches the strict
canonical grammar `A*x+B` / `A*x-B` (`A`, `B` decimal integers without leading zeros, no
spaces) is evaluated in-process with integer arithmetic. Anything else goes to
the code sandbox (`sandbox.run` with hidden IOTests, one sandboxed process per program, on a
pool of `workers` for a batch: `verify_batch`); results other than timeouts are cached by
(program, tests). Reward is 1.0 iff every hidden test passes.
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import itertools
import json
import re

from mopd_jax.tasks import base, sandbox

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


@dataclasses.dataclass(frozen=True)
class CodShape:
  """The generated problems: `num_hidden` hidden tests; the literals A and B of
  `slope_digits` and `intercept_digits` digits; `modulus` the M of `A%M*x + B%M` (3 in the
  module docstring); `stale_prob` the probability that the comment is stale."""
  num_hidden: int = 8
  slope_digits: int = 6
  intercept_digits: int = 4
  modulus: int = 3
  stale_prob: float = 0.3


@base.register("cod")
class CodTask(base.Task):

  # Probability of a 0 among the literals' digits after the first (base.ZERO_PROB: why);
  # None = uniform.
  zero_prob = base.ZERO_PROB

  @classmethod
  def run_options(cls, config, tokenizer) -> dict:
    """The run's `sandbox` block (timeout, memory, backend, workers)."""
    del tokenizer
    return config.sandbox.task_options()

  def __init__(self, *, shape: CodShape = CodShape(), timeout_s: float = 2.0,
               memory_mb: int = 256, cache_size: int = 4096, backend: str | None = None,
               workers: int = 2):
    """`shape`: the generated problems (`CodShape`); `timeout_s`, `memory_mb`, `backend`,
    `workers`: the sandbox's (`run_options`); `cache_size`: the most (program, tests)
    results kept."""
    super().__init__()
    num_hidden, slope_digits, intercept_digits = (shape.num_hidden, shape.slope_digits,
                                                  shape.intercept_digits)
    modulus, stale_prob = shape.modulus, shape.stale_prob
    self.backend, self.workers = backend, workers
    if not (1 <= num_hidden <= 31 and 1 <= slope_digits <= 9 and 1 <= intercept_digits <= 9
            and 2 <= modulus <= 10):
      raise ValueError("need 1 <= num_hidden <= 31, 1 <= *_digits <= 9, 2 <= modulus <= 10")
    if not 0.0 <= stale_prob < 1.0:
      raise ValueError(f"stale_prob must be in [0, 1), got {stale_prob!r}")
    self.num_hidden, self.timeout_s, self.memory_mb = num_hidden, timeout_s, memory_mb
    self.slope_digits, self.intercept_digits = slope_digits, intercept_digits
    self.modulus, self.stale_prob = modulus, stale_prob
    self.cache_size = cache_size
    self._cache = collections.OrderedDict()
    self.num_fast_path = 0
    self.num_sandbox_runs = 0
    self.num_cache_hits = 0

  def _prefix_values(self, literal: str) -> str:
    out, r = [], 0
    for d in literal:
      r = (10 * r + int(d)) % self.modulus
      out.append(str(r))
    return "".join(out)

  def make(self, slope: str, intercept: str, claimed_b: int, *, test_x, seed: int = 0,
           index: int = 0) -> base.Example:
    """The example for the literals `slope` and `intercept` (decimal strings, no leading
    zero), the comment's claimed intercept and the hidden test inputs."""
    m = self.modulus
    for lit in (slope, intercept):
      if not (lit.isdigit() and (lit[0] != "0" or lit == "0")):
        raise ValueError(f"not a decimal literal: {lit!r}")
    code = f"{slope}%{m}*x+{intercept}%{m}"
    ps, pi = self._prefix_values(slope), self._prefix_values(intercept)
    a, b = int(ps[-1]), int(pi[-1])
    expr = canonical_expr(a, b)
    solutions = dict(full=f"={ps}%{m}*x+{pi}%{m}\n#{expr}", brief=f"~{ps}\n#{expr}",
                     direct=f"#{expr}")
    tests = [[int(t), a * int(t) + b] for t in test_x]
    return base.make_example(self.name, seed, index, prompt=f"{code}#b={int(claimed_b)}",
                             answer=expr, solutions=solutions,
                             meta=dict(a=a, b=b, claimed_b=int(claimed_b), tests=tests))

  def problem_key(self, example: base.Example):
    """The program (its slope and intercept literals): the comment's claimed intercept and
    the hidden test inputs do not change the answer."""
    return ("cod", example.prompt.split("#", 1)[0])

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 3)
    m = self.modulus
    digits = min(m, 10)  # digits 0..m-1 (for m = 3: A % 3 is the digit sum mod 3)
    lit = lambda n: str(int(rng.integers(1, digits))) + "".join(
        str(d) for d in base.draw_digits(rng, digits, n - 1, zero_prob=self.zero_prob))
    for i in itertools.count():
      slope, intercept = lit(self.slope_digits), lit(self.intercept_digits)
      b = int(intercept) % m
      claimed = b
      if rng.random() < self.stale_prob:
        claimed = (b + int(rng.integers(1, m))) % m
      test_x = (rng.permutation(31)[:self.num_hidden] - 10).tolist()
      yield self.make(slope, intercept, claimed, test_x=test_x, seed=seed, index=i)

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

  def _plan(self, example: base.Example, response: str):
    """(reward, None) when no sandbox run is needed, else (None, (cache key, source))."""
    tests = example.meta["tests"]
    source, canon = self.program_of(response)
    if source is None:
      return 0.0, None
    if canon is not None:
      self.num_fast_path += 1
      a, b = canon
      return float(all(a * x + b == y for x, y in tests)), None
    key = (source, json.dumps(tests))
    if key in self._cache:
      self.num_cache_hits += 1
      self._cache.move_to_end(key)
      return self._cache[key], None
    return None, (key, source)

  def _remember(self, key, res: sandbox.SandboxResult) -> float:
    r = 1.0 if res.passed else 0.0
    if res.status != "timeout" and self.cache_size > 0:
      self._cache[key] = r
      if len(self._cache) > self.cache_size:
        self._cache.popitem(last=False)
    return r

  def _limits(self) -> sandbox.Limits:
    return sandbox.Limits(timeout_s=self.timeout_s, memory_mb=self.memory_mb)

  def wrong_response(self, example: base.Example) -> str:
    """The program of another problem: b one larger."""
    return "#" + canonical_expr(example.meta["a"], example.meta["b"] + 1)

  def _verify(self, example: base.Example, response: str) -> float:
    r, job = self._plan(example, response)
    if job is None:
      return r
    key, source = job
    self.num_sandbox_runs += 1
    tests = sandbox.IOTests("f", tuple((x, y) for x, y in example.meta["tests"]))
    return self._remember(key, sandbox.run(source, tests, self._limits(), backend=self.backend))

  def verify_batch(self, examples, responses) -> list:
    """`verify` of every row, with the sandbox runs on a pool of `workers` (each distinct
    program once per batch); never raises."""
    if len(examples) != len(responses):
      raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
    out, pending = [0.0] * len(examples), {}
    for i, (ex, resp) in enumerate(zip(examples, responses)):
      self.num_verify_calls += 1
      try:
        r, job = self._plan(ex, resp)
      except Exception as e:  # pylint: disable=broad-except  (as Task.verify)
        self.num_verify_errors += 1
        self.last_verify_error = f"{type(e).__name__}: {e}"[:300]
        continue
      if job is None:
        out[i] = r
      else:
        if job[0] in pending:
          self.num_cache_hits += 1
        pending.setdefault(job[0], (job[1], ex, []))[2].append(i)
    if pending:
      jobs = [(src, sandbox.IOTests("f", tuple((x, y) for x, y in ex.meta["tests"])))
              for src, ex, _ in pending.values()]
      self.num_sandbox_runs += len(jobs)
      try:
        results = sandbox.run_many(jobs, self._limits(), self.backend, workers=self.workers)
      except Exception as e:  # pylint: disable=broad-except  (a verifier never raises)
        self.num_verify_errors += sum(len(rows) for _, _, rows in pending.values())
        self.last_verify_error = f"{type(e).__name__}: {e}"[:300]
        return out
      for (key, (_, _, rows)), res in zip(pending.items(), results):
        r = self._remember(key, res)
        for i in rows:
          out[i] = r
    return out

  def counters(self) -> dict:
    return dict(super().counters(), fast_path=self.num_fast_path,
                sandbox_runs=self.num_sandbox_runs, cache_hits=self.num_cache_hits)


@base.register("cod_uniform")
class CodUniformTask(CodTask):
  """`cod` with uniform digits (see `base.ZERO_PROB`); kept to measure the plateau."""
  zero_prob = None
