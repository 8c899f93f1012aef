"""Verifiers of real-format records, registered by name: `get(name)(response, record) -> float`.

Each returns a reward in [0, 1] and never raises: an error inside a verifier is reward 0 and
is counted on the `Verifier` (`errors`, `last_error`). `record` is the data file's record as a
dict; every record has `prompt`, and each verifier names the fields it reads in `fields`
(`check_record` refuses a record that lacks one, so the data stage can name the file and line).

    math          the final answer of the response (the last `\\boxed{...}`, else the text after
                  the last `####`, else after the last "answer is") against `answer` (a
                  number or LaTeX), equal by the `math-verify` package: LaTeX and plain forms,
                  fractions, decimals, percentages, simple expressions (`\\boxed{\\frac{1}{2}}`
                  matches 0.5). No final answer scores 0.
    python_tests  the response's last fenced code block (or the whole response when it has
                  none) run in the code sandbox (mopd_jax/tasks/sandbox/) with the record's
                  tests: `test` (a program of asserts, or HumanEval's `check(candidate)` called
                  with the function `entry_point`) or `tests` (MBPP's list of assert lines).
                  Assert lines of the form `assert name(literals) == literal` become hidden
                  tests whose expected values the program never sees; any other form runs as a
                  test program. Reward 1 only if every test passes.
    exact         the normalised string or number match of `mopd_jax.tasks.jsonl` (the text
                  after the last `#`, else after "answer:") against `answer`.
    tool          multi-turn tool use (mopd_jax/tasks/tools.py: the record's `tools`, run by
                  the environment during the rollout): the final answer, taken from the text
                  after the last tool observation as `math` takes it (else after the last
                  `#` or "answer:"), against `answer`, equal as normalised strings or by
                  math-verify. Tool calls and observations themselves earn nothing.
"""
from __future__ import annotations

import ast
import re
import threading
from typing import Callable, Mapping, Optional

from mopd_jax.tasks import base, jsonl, sandbox, tools

_REGISTRY: dict = {}
_TOOL_MARKERS: dict = {}  # verifier name -> the tool markers its domain needs


class Verifier:
  """A named reward function of (response, record) that never raises."""

  def __init__(self, name: str, fn: Callable[[str, Mapping], float], fields: tuple,
               *, check: Optional[Callable] = None):
    self.name, self._fn, self.fields, self._check = name, fn, fields, check
    self.calls = self.errors = 0
    self.last_error = ""

  def __call__(self, response: str, record: Mapping) -> float:
    self.calls += 1
    r, error = base.guarded_reward(self._fn, response, record)
    if error is not None:
      self.errors += 1
      self.last_error = error
    return r

  def unguarded(self, response: str, record: Mapping) -> float:
    """The function itself: raises what it raises (a caller that counts errors itself)."""
    return float(self._fn(response, record))

  def check_record(self, record: Mapping) -> Optional[str]:
    """Why `record` cannot be verified (a missing or mistyped field), or None."""
    if not isinstance(record, Mapping):
      return f"expected a record object, got {type(record).__name__}"
    if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
      return "missing or empty field 'prompt'"
    for group in self.fields:  # a tuple of alternatives: at least one is needed
      if not any(record.get(f) not in (None, "", []) for f in group):
        return (f"verifier {self.name!r} needs field {' or '.join(map(repr, group))}")
    return None if self._check is None else self._check(record)


def register(name: str, fields: tuple = (), check: Optional[Callable] = None,
             *, tool_markers: tuple = ()):
  """Registers `fn(response, record) -> float` as verifier `name`; `fields`: tuples of
  alternative field names, one of each needed in every record; `check(record)`: why a
  record is unusable beyond a missing field, or None; `tool_markers`: the four markers of
  the tool calls its domain's rollouts make (() for a domain without tools)."""
  def deco(fn):
    if name in _REGISTRY:
      raise ValueError(f"verifier {name!r} is already registered")
    _REGISTRY[name] = (fn, fields, check)
    _TOOL_MARKERS[name] = tuple(tool_markers)
    return fn
  return deco


def registered() -> tuple:
  return tuple(sorted(_REGISTRY))


def tool_markers(name: str) -> tuple:
  """The tool markers a domain of verifier `name` needs from the tokenizer (() = none)."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown verifier {name!r}; registered: {list(registered())}")
  return _TOOL_MARKERS[name]


def get(name: str, **options) -> Verifier:
  """A fresh `Verifier` (its own counters) of the function registered as `name`; `options`
  are passed to it (e.g. python_tests' sandbox `limits` and `backend`)."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown verifier {name!r}; registered: {list(registered())}")
  fn, fields, check = _REGISTRY[name]
  return Verifier(name, (lambda r, rec: fn(r, rec, **options)) if options else fn, fields,
                  check=check)


# --- math ----------------------------------------------------------------------------------
def _last_boxed(text: str) -> Optional[str]:
  """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced."""
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth, j = 1, i
  while j < len(text) and depth:
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    j += 1
  return text[i:j - 1].strip() if depth == 0 else None


_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*", re.IGNORECASE)


def final_math_answer(response: str) -> Optional[str]:
  """The last `\\boxed{...}`, else the text after the last `####`, else after the last
  "answer is" (to the end of that line); None when there is none."""
  if not isinstance(response, str):
    return None
  boxed = _last_boxed(response)
  if boxed:
    return boxed
  for marker in ("####",):
    k = response.rfind(marker)
    if k >= 0:
      tail = response[k + len(marker):].strip().split("\n", 1)[0].strip()
      return tail or None
  matches = list(_ANSWER_IS.finditer(response))
  if matches:
    tail = response[matches[-1].end():].strip().split("\n", 1)[0].strip().rstrip(".")
    return tail.strip("$ ") or None
  return None


def _math_equal(gold: str, predicted: str) -> bool:
  import math_verify  # pylint: disable=g-import-not-at-top  (sympy: loaded on first use)
  # math-verify's timeouts use SIGALRM, which only the main thread may set.
  main = threading.current_thread() is threading.main_thread()
  kw = {} if main else {"parsing_timeout": None}
  g = math_verify.parse("\\boxed{%s}" % gold, **kw)
  p = math_verify.parse("\\boxed{%s}" % predicted, **kw)
  if not g or not p:
    return False
  return bool(math_verify.verify(g, p, **({} if main else {"timeout_seconds": None})))


@register("math", fields=(("answer",),))
def verify_math(response: str, record: Mapping) -> float:
  predicted = final_math_answer(response)
  if predicted is None:
    return 0.0
  gold = record["answer"]
  if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
    raise ValueError(f"'answer' must be a number or a string, got {type(gold).__name__}")
  gold = str(gold)
  if "####" in gold:  # a GSM8K-style answer with its reasoning
    gold = gold.rsplit("####", 1)[1].strip()
  return float(_math_equal(gold, predicted))


# --- code ----------------------------------------------------------------------------------
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> Optional[str]:
  """The last fenced code block of a response, else the response itself."""
  if not isinstance(response, str) or not response.strip():
    return None
  blocks = _FENCE.findall(response)
  code = blocks[-1] if blocks else response
  return code if code.strip() else None


def hidden_tests(lines) -> Optional[sandbox.IOTests]:
  """MBPP assert lines as hidden IOTests when every line is `assert f(literals) == literal`
  (one function name throughout), else None."""
  pairs, func = [], None
  for line in lines:
    try:
      node = ast.parse(line.strip(), mode="exec").body
    except (SyntaxError, ValueError):
      return None
    if len(node) != 1 or not isinstance(node[0], ast.Assert) or node[0].msg is not None:
      return None
    test = node[0].test
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and
            isinstance(test.ops[0], ast.Eq) and isinstance(test.left, ast.Call) and
            isinstance(test.left.func, ast.Name) and not test.left.keywords):
      return None
    name = test.left.func.id
    if func not in (None, name):
      return None
    func = name
    try:
      args = tuple(ast.literal_eval(a) for a in test.left.args)
      expected = ast.literal_eval(test.comparators[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
      return None
    pairs.append((args, expected))
  if not pairs or func is None or func[:1] == "_":
    return None
  try:
    sandbox.normalise_tests(pairs)  # plain JSON-like values only
  except ValueError:
    return None
  return sandbox.IOTests(func, tuple(pairs))


def code_tests(record: Mapping):
  """The record's tests as sandbox tests: hidden IOTests where the asserts allow it, else a
  ProgramTests of the `test` program (with `entry_point`) or of the `tests` lines."""
  tests, test = record.get("tests"), record.get("test")
  if tests:
    if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
      raise ValueError("'tests' must be a list of assert lines")
    hidden = hidden_tests(tests)
    if hidden is not None:
      return hidden
    return sandbox.ProgramTests("\n".join(tests) + "\n", "", len(tests))
  if not isinstance(test, str) or not test.strip():
    raise ValueError("the record has neither 'test' nor 'tests'")
  entry = record.get("entry_point") or ""
  if "def check(" in test and entry:
    return sandbox.ProgramTests(test, entry)
  hidden = hidden_tests([l for l in test.splitlines() if l.strip()])
  return hidden if hidden is not None else sandbox.ProgramTests(test)


@register("python_tests", fields=(("test", "tests"),))
def verify_python_tests(response: str, record: Mapping, *,
                        limits: sandbox.Limits = sandbox.Limits(timeout_s=5.0),
                        backend: Optional[str] = None) -> float:
  code = extract_code(response)
  if code is None:
    return 0.0
  return float(sandbox.run(code, code_tests(record), limits, backend=backend).passed)


# --- exact ---------------------------------------------------------------------------------
@register("exact", fields=(("answer",),))
def verify_exact(response: str, record: Mapping) -> float:
  return float(jsonl.answers_match(jsonl.extract_answer(response), str(record["answer"])))


# --- tool ----------------------------------------------------------------------------------
_OBSERVATION_ENDS = ("</tool_response>", "</obs>")


@register("tool", fields=(("answer",), ("tools",)),
          check=lambda record: tools.check_tools(record["tools"]), tool_markers=tools.MARKERS)
def verify_tool(response: str, record: Mapping) -> float:
  if not isinstance(response, str):
    return 0.0
  tail = response
  for marker in _OBSERVATION_ENDS:  # only the text after the last observation answers
    k = tail.rfind(marker)
    if k >= 0:
      tail = tail[k + len(marker):]
  predicted = final_math_answer(tail) or jsonl.extract_answer(tail)
  if not predicted:
    return 0.0
  gold = record["answer"]
  if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
    raise ValueError(f"'answer' must be a number or a string, got {type(gold).__name__}")
  if jsonl.answers_match(predicted, str(gold)):
    return 1.0
  return float(_math_equal(str(gold), predicted))
