"""Tools of record domains: the environment that executes a policy's tool calls.

A call is the JSON between the tokenizer's call markers, in the Qwen style:

    <tool_call>{"name": "search", "arguments": {"query": "capital"}}</tool_call>

and its observation is the tool's result between the observation markers (Qwen's
`<tool_response>` ... `</tool_response>`), inserted by the rollout with loss mask 0, so no
loss and no teacher score lands on it. A record defines its tools in a `tools` object:

    {"prompt": "...", "answer": "1889",
     "tools": {"documents": {"Eiffel Tower": "The tower was completed in 1889.", ...},
               "calculator": true}}

    search(query)       the titles of the documents holding every word of `query`
                        (case-insensitive), at most 5, in the record's order
    lookup(title)       the text of the document with that title
    calculator(expression)
                        the value of an arithmetic expression (numbers, + - * / // % **,
                        parentheses; exponents up to 100, results up to 1e100)

`search` and `lookup` exist when the record has `documents`; `calculator` when `calculator`
is true. A malformed call (not JSON, no such tool, bad arguments) gets an error observation;
`step` never raises.
"""
from __future__ import annotations

import ast
import json
import operator
from typing import Mapping

# The markers a record's tool calls and observations are written with (call, call end,
# observation, observation end): what the tokenizer gives `call_id` ... `obs_end_id`.
MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
MAX_RESULTS = 5
MAX_OBSERVATION_CHARS = 400
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def check_tools(tools) -> str | None:
  """Why a record's `tools` object is unusable, or None."""
  if not isinstance(tools, Mapping):
    return "'tools' must be an object"
  unknown = sorted(set(tools) - {"documents", "calculator"})
  if unknown:
    return f"'tools' has unknown key(s) {unknown}; known: ['calculator', 'documents']"
  docs = tools.get("documents")
  if docs is not None and not (isinstance(docs, Mapping) and all(
      isinstance(k, str) and isinstance(v, str) for k, v in docs.items())):
    return "'tools.documents' must map titles to texts"
  if not docs and not tools.get("calculator"):
    return "'tools' defines no tool (give 'documents' or 'calculator': true)"
  return None


def calculate(expression: str) -> float | int:
  """The value of an arithmetic expression; ValueError for anything else."""
  if not isinstance(expression, str) or len(expression) > 200:
    raise ValueError("expression must be a string of at most 200 characters")

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
      a, b = ev(node.left), ev(node.right)
      if isinstance(node.op, ast.Pow) and abs(b) > 100:
        raise ValueError("exponent too large")
      out = _BINARY[type(node.op)](a, b)
      if abs(out) > 1e100:
        raise ValueError("result too large")
      return out
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
      return _UNARY[type(node.op)](ev(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")

  try:
    return ev(ast.parse(expression.strip(), mode="eval"))
  except ZeroDivisionError:
    raise ValueError("division by zero") from None
  except SyntaxError:
    raise ValueError("not an arithmetic expression") from None


def _search(docs: Mapping, query) -> str:
  if not isinstance(query, str) or not query.strip():
    raise ValueError("search needs a non-empty 'query' string")
  words = query.lower().split()
  hits = [t for t, text in docs.items()
          if all(w in (t + " " + text).lower() for w in words)][:MAX_RESULTS]
  return json.dumps(hits) if hits else "no results"


def _lookup(docs: Mapping, title) -> str:
  if not isinstance(title, str) or title not in docs:
    raise ValueError(f"no document titled {title!r}")
  return docs[title]


class ToolEnvironment:
  """Executes the tool calls of record domains (`RecordsTask.environment`); the
  observation markers are the tokenizer's (Run.task passes them)."""

  def __init__(self, markers: tuple = ("<tool_response>", "</tool_response>")):
    self.open, self.close = markers

  def _wrap(self, text: str) -> str:
    text = str(text)[:MAX_OBSERVATION_CHARS]
    for marker in (self.open, self.close):  # a result never forges a marker
      text = text.replace(marker, "")
    return f"{self.open}{text}{self.close}"

  def run(self, tools: Mapping, call: str) -> str:
    """The result text of one call; ValueError for a malformed one."""
    try:
      obj = json.loads(call.strip())
    except (ValueError, RecursionError):
      raise ValueError("the call is not JSON") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
      raise ValueError('a call is {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
      raise ValueError("'arguments' must be an object")
    name, docs = obj["name"], tools.get("documents") or {}
    if name == "search" and docs:
      return _search(docs, args.get("query"))
    if name == "lookup" and docs:
      return _lookup(docs, args.get("title"))
    if name == "calculator" and tools.get("calculator"):
      return repr(calculate(args.get("expression")))
    raise ValueError(f"no tool named {name!r}")

  def step(self, example, call: str) -> str:
    """The observation (markers included) of `call`, the text between the call markers, for
    `example` (its record's `tools`); never raises."""
    try:
      tools = example.meta.get("record", {}).get("tools")
      if check_tools(tools) is not None:
        return self._wrap("error: this task has no tools")
      return self._wrap(self.run(tools, call))
    except Exception as e:  # pylint: disable=broad-except  (a bad call must not kill a rollout)
      return self._wrap(f"error: {e}")
