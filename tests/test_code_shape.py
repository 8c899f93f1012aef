"""The shape of the code in mopd_jax/: no module over 500 lines, no function with more than 8
parameters (positional and keyword-only, without self / cls; *args and **kwargs count one
each). A wider call takes the typed config block or a small frozen dataclass instead."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "mopd_jax"
MAX_LINES = 500
MAX_PARAMS = 8

# Pending: these files are being changed for the teacher server (issue 41); they are split
# or narrowed once that lands, and then leave these lists.
PENDING_MODULES = {
    "config.py",  # gains `teacher.endpoints`
}
PENDING_FUNCTIONS = {
    # Its only caller in the pipeline is stages/mopd.py; it is to take `mopd.StepSetup`.
    "mopd.py:sample_batch",
    # Built from `config.tokenizer_options()`, whose keys are its parameters.
    "tokenizer.py:HFTokenizer.__init__",
    # The teacher server's `with_rank` made it 9; its options are to become one dataclass.
    "logprobs.py:token_stats_from_hidden",
}


def _modules():
  return sorted(ROOT.rglob("*.py"))


def _functions(tree):
  """(qualified name, node) of every function and method, nested ones included."""
  def walk(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield prefix + child.name, child
        yield from walk(child, prefix + child.name + ".")
      elif isinstance(child, ast.ClassDef):
        yield from walk(child, prefix + child.name + ".")
      else:
        yield from walk(child, prefix)
  yield from walk(tree, "")


def num_params(fn: ast.FunctionDef) -> int:
  a = fn.args
  positional = [x.arg for x in a.posonlyargs + a.args]
  if positional and positional[0] in ("self", "cls"):
    positional = positional[1:]
  return (len(positional) + len(a.kwonlyargs) + (a.vararg is not None)
          + (a.kwarg is not None))


def test_no_module_over_500_lines():
  long = {}
  for path in _modules():
    rel = path.relative_to(ROOT).as_posix()
    n = len(path.read_text().splitlines())
    if n > MAX_LINES and rel not in PENDING_MODULES:
      long[rel] = n
  assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def test_no_function_over_8_parameters():
  wide, seen = {}, set()
  for path in _modules():
    rel = path.relative_to(ROOT).as_posix()
    for name, fn in _functions(ast.parse(path.read_text())):
      key = f"{rel}:{name}"
      n = num_params(fn)
      if n > MAX_PARAMS:
        seen.add(key)
        if key not in PENDING_FUNCTIONS:
          wide[key] = n
  assert not wide, (f"functions with more than {MAX_PARAMS} parameters (group them into the "
                    f"config block or a frozen dataclass): {wide}")
  assert PENDING_FUNCTIONS <= seen, ("narrowed: remove from PENDING_FUNCTIONS: "
                                     f"{sorted(PENDING_FUNCTIONS - seen)}")


def test_pending_modules_are_still_long():
  """A pending module that has been split leaves the list, so the limit then holds for it."""
  done = [rel for rel in PENDING_MODULES
          if len((ROOT / rel).read_text().splitlines()) <= MAX_LINES]
  assert not done, f"under {MAX_LINES} lines now: remove from PENDING_MODULES: {done}"


def test_the_count_follows_the_rule():
  """*args and **kwargs count one each; self and cls do not count."""
  src = ("class C:\n  def m(self, a, b, *args, c, **kw): pass\n"
         "def f(a, /, b, *, c=1): pass\n")
  got = {name: num_params(fn) for name, fn in _functions(ast.parse(src))}
  assert got == {"C.m": 5, "f": 3}
