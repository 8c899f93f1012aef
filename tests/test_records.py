"""Records of a domain's data files (mopd_jax/tasks/records.py): JSONL and Parquet, checked
against their verifier, deduplicated, the test split disjoint from train."""
import json

import pytest

from mopd_jax.tasks import base, records


def _jsonl(path, rows):
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
  return str(path)


def _parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


MATH = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": 4, "solution": "#### 4"},
        {"prompt": "1+1?", "answer": "2"}, {"prompt": "3*3?", "answer": "9"}]


def test_jsonl_and_parquet_splits_with_duplicates_dropped(tmp_path):
  train = _jsonl(tmp_path / "train.jsonl", MATH)
  test = _parquet(tmp_path / "test.parquet", [{"prompt": "5-1?", "answer": "4"},
                                              {"prompt": "5-1?", "answer": "4"}])
  tr, te, counts = records.load_domain(train, test, "math")
  assert [r.fields["prompt"] for r in tr] == ["1+1?", "2+2?", "3*3?"]
  assert tr[1].fields["solution"] == "#### 4" and tr[1].source == "train.jsonl:2"
  assert te[0].source == "test.parquet:row 0"
  assert counts.to_json() == {"train": 3, "test": 1, "train_duplicates": 1,
                              "test_duplicates": 1}


def test_test_prompt_in_train_is_refused(tmp_path):
  train = _jsonl(tmp_path / "train.jsonl", MATH)
  test = _jsonl(tmp_path / "test.jsonl", [{"prompt": "7?", "answer": "7"},
                                          {"prompt": " 3*3? ", "answer": "9"}])
  with pytest.raises(base.DataError, match=r"test.jsonl: test.jsonl:2 has the same prompt as "
                     r"the training record train.jsonl:4"):
    records.load_domain(train, test, "math")


@pytest.mark.parametrize("rows, verifier, match", [
    ([{"prompt": "p"}], "math", r"train.jsonl:1: verifier 'math' needs field 'answer'"),
    ([{"prompt": "p", "answer": 1}, {"prompt": "q", "entry_point": "f"}], "python_tests",
     r"train.jsonl:1: verifier 'python_tests' needs field 'test' or 'tests'"),
    ([{"answer": 1}], "exact", r"train.jsonl:1: missing or empty field 'prompt'"),
    (['{"prompt": "p", "answer": 1', ], "math", r"train.jsonl:1: malformed JSON"),
    ([{"prompt": "p", "answer": 1}], "maths", r"unknown verifier 'maths'"),
])
def test_bad_records_name_the_file_and_line(tmp_path, rows, verifier, match):
  train = _jsonl(tmp_path / "train.jsonl", rows)
  test = _jsonl(tmp_path / "test.jsonl", [{"prompt": "z", "answer": 1, "test": "x"}])
  with pytest.raises(base.DataError, match=match):
    records.load_domain(train, test, verifier)


def test_bad_files(tmp_path):
  with pytest.raises(base.DataError, match="unsupported data file"):
    records.read(str(tmp_path / "x.csv"))
  (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
  with pytest.raises(base.DataError, match="broken.parquet: not a readable Parquet file"):
    records.read(str(tmp_path / "broken.parquet"))
  with pytest.raises(base.DataError, match="no such file"):
    records.read(str(tmp_path / "none.parquet"))
