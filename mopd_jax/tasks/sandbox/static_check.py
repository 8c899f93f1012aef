"""The static pre-check of the in-process barrier: a program is refused, unrun, for imports,
classes, `with`, dunder or frame-walking names and attributes (a check, not a boundary)."""
from __future__ import annotations

import ast

from .protocol import MAX_SOURCE_CHARS

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


def check_source(source: str, func_name: str | None = "f") -> str | None:
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
    if isinstance(node, ast.MatchClass):  # `case C(__globals__=g)` reads an attribute
      for attr in node.kwd_attrs:
        if attr[:1] == "_" or attr in _BANNED_ATTRS:
          return "forbidden attribute %s" % attr
    name = getattr(node, "id", None) or getattr(node, "arg", None) or getattr(node, "name", None)
    if isinstance(name, str) and (name[:2] == "__" or name in _BANNED_NAMES):
      return "forbidden name %s" % name
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
      if ("__" if isinstance(node.value, str) else b"__") in node.value:  # getattr-free tricks
        return "forbidden string constant"
  if func_name and not any(isinstance(n, ast.FunctionDef) and n.name == func_name
                           for n in tree.body):
    return "no top-level function %s" % func_name
  return None
