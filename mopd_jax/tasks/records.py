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
"""
from __future__ import annotations

import dataclasses
import os

from mopd_jax.tasks import base, jsonl, verifiers

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
  if not os.path.isfile(path):
    raise base.DataError(f"{path}: no such file")
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top  (a TFDS dependency)
  try:
    rows = pq.read_table(path).to_pylist()
  except Exception as e:  # pylint: disable=broad-except  (pyarrow's own error types)
    raise base.DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: "
                         f"{e})") from None
  name = os.path.basename(path)
  return [Record(row, f"{name}:row {i}") for i, row in enumerate(rows)]


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
