"""The main job installs with `pip install -e .` alone: every third-party package that the
library imports at module level is a base dependency in setup.py, not only a test extra's
(safetensors once came only through transformers, and the quickstart's main job failed on a
fresh machine)."""
import ast
import importlib.metadata
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported by the library but installed by a base dependency of its own accord (jax brings
# ml_dtypes and opt_einsum; orbax-checkpoint brings etils).
BROUGHT_BY_OTHERS = {"ml_dtypes", "etils", "opt_einsum"}


def _base_requirements() -> set:
  text = open(os.path.join(ROOT, "setup.py")).read()
  block = text[text.index("install_requires=["):text.index("]", text.index("install_requires"))]
  return {_norm(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0])
          for r in re.findall(r'"([^"]+)"', block)}


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _module_level_imports(path: str) -> set:
  """Top-level package names imported outside functions (what importing the module needs)."""
  names = set()
  for node in ast.parse(open(path).read()).body:
    if isinstance(node, ast.Import):
      names.update(a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split(".")[0])
  return names


def test_library_imports_are_base_dependencies():
  imported = set()
  for folder, _, files in os.walk(os.path.join(ROOT, "mopd_jax")):
    for f in files:
      if f.endswith(".py"):
        imported |= _module_level_imports(os.path.join(folder, f))
  third_party = {n for n in imported
                 if n not in sys.stdlib_module_names and n not in ("mopd_jax", "__future__")}
  dists = importlib.metadata.packages_distributions()
  required = _base_requirements()
  missing = sorted(n for n in third_party - BROUGHT_BY_OTHERS
                   if not {_norm(d) for d in dists.get(n, [n])} & required)
  assert not missing, f"imported by mopd_jax but not in setup.py's install_requires: {missing}"
