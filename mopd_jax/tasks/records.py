"""A domain's records from data files: JSONL or Parquet, checked, deduplicated, split-disjoint.

    train, test, counts = load_domain("math_train.jsonl", "math_test.parquet", "math")

Each record is a dict with at least a non-empty `prompt`, plus the fields its verifier reads
(`mopd_jax.tasks.verifiers`, e.g. `answer` for math, `test` or `tests` for python_tests);
other fields are kept. `load_domain` drops exact-duplicate prompts within a split (the first
occurrence is kept), refuses a test prompt that also appears in train (a test split must be
disjoint from training by its problems), and returns the counts the data stage records.

Errors (DataError, a ValueError) name the file and the 1-based line (JSONL) or row (Parquet):
every JSONL error of `jsonl.iter_records`, a record its verifier cannot check (a missing
field), an unknown verifier name, a file of another format, a Parquet file that cannot be
read, and a test prompt found in train (with both places).

A domain of records runs the registered task `records` (`RecordsTask`): `examples` turns its
records into `Example`s (the prompt, b0 by `budget_source`, the reference response as the
"full" solution for SFT, the record and its verifier's name in `meta`), and the task scores
a response with the record's verifier. The data stage stores those examples as the same
TFDS array_record splits the toy uses (mopd_jax/tasks/datasets.py).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import os
from typing import Optional

from mopd_jax.io import storage
from mopd_jax.tasks import base, jsonl, tools, verifiers

FORMATS = (".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class Record:
  fields: dict
  source: str  # "file:line" (JSONL) or "file:row N" (Parquet), for error messages


def read(path: str) -> list:
  """The `Record`s of a JSONL or Parquet file, in file order (blank JSONL lines skipped)."""
  path = os.fspath(path)
  ext = os.path.splitext(path)[1].lower()
  if ext == ".jsonl":
    name = os.path.basename(path)
    return [Record(rec, f"{name}:{lineno}") for lineno, rec in jsonl.iter_records(path)
            if rec is not None]
  if ext == ".parquet":
    return _read_parquet(path)
  raise base.DataError(f"{path}: unsupported data file; expected one of {FORMATS}")


def _read_parquet(path: str) -> list:
  where = storage.path(path)  # local or object storage (gs://...)
  if not where.is_file():
    raise base.DataError(f"{path}: no such file")
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (a TFDS dependency)
  try:
    with where.open("rb") as f:
      rows = pq.read_table(f).to_pylist()
  except Exception as e:  # pylint: disable=broad-except  (pyarrow's own error types)
    raise base.DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                         f"{e})") from None
  name = os.path.basename(path)
  return [Record(row, f"{name}:row {i}") for i, row in enumerate(rows)]


def fingerprint(paths) -> str:
  """A digest of the files' bytes (sha256), to key what is built from them: the same for the
  same bytes wherever they are (local or object storage). Each file is hashed once per
  process while its size and modification time stay the same (a run asks for it at every
  split it loads)."""
  h = hashlib.sha256()
  for path in paths:
    path = os.fspath(path)
    try:  # a local file's time to the nanosecond; object storage gives seconds
      if storage.is_remote(path):
        st = storage.path(path).stat()
        key = (st.length, st.mtime)
      else:
        st = os.stat(path)
        key = (st.st_size, st.st_mtime_ns)
    except OSError as e:
      raise base.DataError(f"{path}: cannot read ({e.strerror or e})") from None
    h.update(_file_digest(path, *key).encode())
  return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime: float) -> str:
  del size, mtime  # the cache key: a changed file is hashed again
  h = hashlib.sha256()
  try:
    with storage.path(path).open("rb") as f:
      for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
  except OSError as e:
    raise base.DataError(f"{path}: cannot read ({e.strerror or e})") from None
  return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Counts:
  train: int
  test: int
  train_duplicates: int
  test_duplicates: int

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _checked(records: list, verifier: verifiers.Verifier, path: str) -> tuple:
  """The records with a distinct prompt (first kept), each checked against `verifier`;
  (records, number of duplicates dropped)."""
  seen, out, dups = set(), [], 0
  for r in records:
    why = verifier.check_record(r.fields)
    if why is not None:  # the file's path, then its line or row
      raise base.DataError(f"{os.path.join(os.path.dirname(path), r.source)}: {why}")
    key = r.fields["prompt"].strip()
    if key in seen:
      dups += 1
      continue
    seen.add(key)
    out.append(r)
  return out, dups


def load_domain(train_path: str, test_path: str, verifier: str) -> tuple:
  """(train records, test records, Counts) of one domain; see the module docstring."""
  try:
    v = verifiers.get(verifier)
  except ValueError as e:  # an unknown name: said as a data error of this domain's files
    raise base.DataError(f"{train_path}: {e}") from None
  train, train_dups = _checked(read(train_path), v, train_path)
  test, test_dups = _checked(read(test_path), v, test_path)
  where = {r.fields["prompt"].strip(): r.source for r in train}
  for r in test:
    hit = where.get(r.fields["prompt"].strip())
    if hit is not None:
      raise base.DataError(f"{test_path}: {r.source} has the same prompt as the training "
                           f"record {hit}; a test split must not share problems with train")
  return train, test, Counts(len(train), len(test), train_dups, test_dups)


# --- records as examples ----------------------------------------------------------------------
BUDGET_SOURCES = ("field", "reference", "samples")


def reference_response(fields: dict) -> Optional[str]:
  """The record's reference response: `solution`, else `canonical_solution` in a fenced
  Python block (a HumanEval body indented under the prompt's signature is joined to the
  prompt's code first), else None."""
  sol = fields.get("solution")
  if isinstance(sol, str) and sol.strip():
    return sol
  code = fields.get("canonical_solution")
  if not (isinstance(code, str) and code.strip()):
    return None
  if code[:1] in (" ", "\t") and "def " in fields.get("prompt", ""):
    code = fields["prompt"] + code  # HumanEval: the body of the prompt's function
  return "```python\n" + code.strip("\n") + "\n```"


@dataclasses.dataclass
class ExampleCounts:
  """What `examples` kept and dropped, for the data stage's DONE file."""
  kept: int = 0
  no_budget: int = 0  # b0 could not be set (no `budget` field / no reference response)
  too_long: int = 0  # prompt over the limit (skipped; on_too_long="skip")


def examples(recs: list, domain: str, verifier: str, *, budget_source: str, tok,
             prompt_tokens, max_prompt_tokens: int = 0, on_too_long: str = "skip") -> tuple:
  """(Examples, ExampleCounts) of `recs` (`Record`s of one split, in order).

  b0 by `budget_source`: "field" reads the record's positive-int `budget`; "reference" is
  the toy's rule on the reference response's tokens (`base.compute_b0` with `tok`); with
  "samples" every b0 is 1 here, a placeholder the rl stage replaces by the measured one
  (mopd_jax/tasks/budgets.py) before anything reads a budget. A record whose b0 cannot be set is
  dropped and counted. `prompt_tokens(text)`: the prompt's length
  in tokens as the student sees it; over `max_prompt_tokens` (> 0) a record is skipped and
  counted, or raises (`on_too_long="error"`); nothing is truncated."""
  if budget_source not in BUDGET_SOURCES:
    raise ValueError(f"budget source {budget_source!r}; expected one of {BUDGET_SOURCES}")
  if on_too_long not in base.ON_TOO_LONG:
    raise ValueError(f"on_too_long must be one of {base.ON_TOO_LONG}, got {on_too_long!r}")
  out, counts = [], ExampleCounts()
  for r in recs:
    f = r.fields
    ref = reference_response(f)
    if budget_source == "samples":
      b0 = 1  # a placeholder: measured from samples of pi_SFT by the rl stage
    elif budget_source == "field":
      b0 = f.get("budget")
      b0 = b0 if isinstance(b0, int) and not isinstance(b0, bool) and b0 > 0 else None
    else:
      try:
        b0 = None if ref is None else base.compute_b0(ref, tok)
      except ValueError as e:  # text the tokenizer cannot encode
        raise base.DataError(f"{r.source}: the reference response: {e}") from None
    if b0 is None:
      counts.no_budget += 1
      continue
    try:
      n = prompt_tokens(f["prompt"])
    except ValueError as e:  # text the tokenizer cannot encode
      raise base.DataError(f"{r.source}: {e}") from None
    if max_prompt_tokens and n > max_prompt_tokens:
      if on_too_long == "error":
        raise base.DataError(f"{r.source}: the prompt has {n} tokens, over "
                             f"data.max_prompt_tokens={max_prompt_tokens}")
      counts.too_long += 1
      continue
    answer = f.get("answer")
    out.append(base.Example(
        uid=f"{domain}:{r.source}", domain=domain, prompt=f["prompt"], b0=int(b0),
        answer="" if answer is None else str(answer),
        solutions={} if ref is None else {"full": ref},
        meta={"verifier": verifier, "record": f, "source": r.source}))
  counts.kept = len(out)
  return out, counts


@base.register("records")
class RecordsTask(base.Task):
  """A domain of records from data files: each example is scored by its record's verifier
  (`meta["verifier"]`, mopd_jax.tasks.verifiers) on `meta["record"]`. Code verifiers run
  in the configured sandbox; a batch is verified on `workers` threads. The environment runs
  the tool calls of records that define `tools` (mopd_jax/tasks/tools.py)."""
  generated = False

  @classmethod
  def run_options(cls, config, tokenizer) -> dict:
    """The run's `sandbox` block, and the tokenizer's observation markers if it has them."""
    options = config.sandbox.task_options()
    if tokenizer.obs_id is not None:
      options["observation_markers"] = (tokenizer.decode([tokenizer.obs_id]),
                                        tokenizer.decode([tokenizer.obs_end_id]))
    return options

  # The domain's tool markers depend on its verifier (verifiers.tool_markers), not on the
  # class: mopd_jax/configure.py asks the verifier.

  def __init__(self, backend: Optional[str] = None, workers: int = 2,
               timeout_s: float = 5.0, *, memory_mb: int = 256,
               observation_markers: tuple = tools.MARKERS[2:]):
    super().__init__()
    from mopd_jax.tasks import sandbox  # pylint: disable=g-import-not-at-top
    self.environment = tools.ToolEnvironment(tuple(observation_markers))
    self.workers = workers
    self._options = {"python_tests": dict(
        limits=sandbox.Limits(timeout_s=timeout_s, memory_mb=memory_mb), backend=backend)}
    self._verifiers: dict = {}

  def _verifier(self, name: str) -> verifiers.Verifier:
    if name not in self._verifiers:
      self._verifiers[name] = verifiers.get(name, **self._options.get(name, {}))
    return self._verifiers[name]

  def _verify(self, example: base.Example, response: str) -> float:
    # The unguarded function: Task.verify counts its errors (reward 0).
    return self._verifier(example.meta["verifier"]).unguarded(response, example.meta["record"])

  def verify_batch(self, examples, responses) -> list:
    """`verify` of every row, the rows on `workers` threads (a code verifier's sandbox runs
    each program in its own process tree); never raises."""
    if len(examples) != len(responses):
      raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
    if self.workers <= 1 or len(examples) <= 1:
      return [self.verify(ex, r) for ex, r in zip(examples, responses)]
    for ex in examples:  # create the verifiers here, not racing in the threads
      self._verifier(ex.meta["verifier"])
    with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers) as pool:
      results = list(pool.map(lambda a: base.guarded_reward(self._verify, *a),
                              zip(examples, responses)))
    out = []
    for r, error in results:  # the counters are updated here, on one thread
      self.num_verify_calls += 1
      if error is not None:
        self.num_verify_errors += 1
        self.last_verify_error = error
      out.append(r)
    return out

