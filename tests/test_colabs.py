"""The Colab notebooks run top to bottom (tiny setting, so notebooks never rot) and are
committed without outputs. The quickstart runs in the default tier; the other three run in
the slow tier, and the default tier checks every library name and keyword argument they use
against the code (a renamed function or argument fails there)."""
import ast
import importlib
import inspect
import os

import nbclient
import nbformat
import pytest
import suite_cli

ROOT = suite_cli.ROOT
COLABS = os.path.join(ROOT, "colabs")
NAMES = ("01_quickstart.ipynb", "02_mopd_loss.ipynb", "03_sampling_and_teachers.ipynb",
         "04_sharding.ipynb")


def test_every_notebook_is_listed():
  assert sorted(f for f in os.listdir(COLABS) if f.endswith(".ipynb")) == list(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_without_outputs(name):
  nb = nbformat.read(os.path.join(COLABS, name), as_version=4)
  nbformat.validate(nb)
  for i, cell in enumerate(nb.cells):
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, (
          f"{name} cell {i} has outputs; strip them before committing (e.g. "
          f"`jupyter nbconvert --clear-output --inplace colabs/{name}`)")


def _resolve(module: str, name: str):
  try:
    return importlib.import_module(f"{module}.{name}")
  except ModuleNotFoundError:
    return getattr(importlib.import_module(module), name)


def _library_uses(source: str):
  """(expression, object, call keywords) for every `alias.attr...` and call of a name the
  notebook imports from `mopd_jax` or `configs`; raises AttributeError on a missing name."""
  tree = ast.parse(source)
  names = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("mopd_jax", "configs"):
      for a in node.names:
        names[a.asname or a.name] = _resolve(node.module, a.name)

  def lookup(expr):
    if isinstance(expr, ast.Name):
      return names.get(expr.id)
    if isinstance(expr, ast.Attribute):
      base = lookup(expr.value)
      if base is not None and inspect.ismodule(base):
        if not hasattr(base, expr.attr):
          raise AttributeError(f"{ast.unparse(expr)}: {base.__name__} has no {expr.attr!r}")
        return getattr(base, expr.attr)
    return None

  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute):
      lookup(node)
    if isinstance(node, ast.Call) and (fn := lookup(node.func)) is not None and callable(fn):
      yield ast.unparse(node.func), fn, [k.arg for k in node.keywords if k.arg]


@pytest.mark.parametrize("name", NAMES)
def test_library_names_and_keywords_exist(name):
  """Every function, class and keyword argument a notebook takes from the library exists
  with that name (a guard of the notebooks the default tier does not execute)."""
  nb = nbformat.read(os.path.join(COLABS, name), as_version=4)
  source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  calls = 0
  for expr, fn, keywords in _library_uses(source):
    try:
      params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: no signature to check
      continue
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
      continue
    calls += 1
    assert not set(keywords) - set(params), f"{name}: {expr}() has no {set(keywords) - set(params)}"
  assert calls >= 3, f"{name}: no library calls found"


@pytest.mark.parametrize("name", [
    NAMES[0], *(pytest.param(n, marks=pytest.mark.slow) for n in NAMES[1:])])
def test_runs_top_to_bottom(name, tmp_path, monkeypatch):
  # The kernel inherits this environment: the tiny setting, a fresh workdir, and the suite's
  # XLA flags without the 8 simulated devices of conftest.py (01-03 use one device; 04 asks
  # for 8 itself).
  monkeypatch.setenv("MOPD_COLAB_TINY", "1")
  monkeypatch.setenv("MOPD_COLAB_WORKDIR", str(tmp_path / "workdir"))
  monkeypatch.setenv("XLA_FLAGS", suite_cli.xla_flags())
  nb = nbformat.read(os.path.join(COLABS, name), as_version=4)
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": COLABS}})
  client.execute()  # raises CellExecutionError naming the failing cell
