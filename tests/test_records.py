"""Records of a domain's data files (mopd_jax/tasks/records.py): JSONL and Parquet, checked
against their verifier, deduplicated, the test split disjoint from train."""
import json
import os

import pytest

from mopd_jax import configure
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


def test_examples_budgets_skips_and_references(tmp_path):
  """b0 from the reference's tokens or a `budget` field; records without one dropped and
  counted; over-long prompts skipped and counted, or an error naming the line; HumanEval's
  indented body joined to the prompt's signature; the task verifies by the record's
  verifier."""
  from mopd_jax.io.tokenizer import CharTokenizer
  tok = CharTokenizer()
  rows = [{"prompt": "2+2?", "answer": 4, "solution": "2+2=4\n#### 4", "budget": 9},
          {"prompt": "3+3?", "answer": 6},
          {"prompt": "x" * 50, "answer": 1, "solution": "#### 1", "budget": 3}]
  recs = records.read(_jsonl(tmp_path / "t.jsonl", rows))
  exs, c = records.examples(recs, "math", "math", budget_source="reference", tok=tok,
                            prompt_tokens=lambda t: len(tok.encode(t)), max_prompt_tokens=20)
  assert [e.prompt for e in exs] == ["2+2?"] and (c.no_budget, c.too_long) == (1, 1)
  assert exs[0].b0 == base.compute_b0("2+2=4\n#### 4", tok)
  assert exs[0].solutions == {"full": "2+2=4\n#### 4"} and exs[0].meta["verifier"] == "math"
  exs, c = records.examples(recs, "math", "math", budget_source="field", tok=tok,
                            prompt_tokens=len)
  assert [e.b0 for e in exs] == [9, 3] and c.no_budget == 1
  with pytest.raises(base.DataError, match=r"t.jsonl:3: the prompt has 50 tokens"):
    records.examples(recs, "math", "math", budget_source="field", tok=tok, prompt_tokens=len,
                     max_prompt_tokens=20, on_too_long="error")
  he = {"prompt": "def f(x):\n    \"\"\"x+1\"\"\"\n", "canonical_solution": "    return x + 1\n"}
  assert records.reference_response(he) == \
      "```python\ndef f(x):\n    \"\"\"x+1\"\"\"\n    return x + 1\n```"
  task = base.get_task("records", workers=2, backend="inprocess")
  code = {"prompt": "inc", "tests": ["assert inc(1) == 2"]}
  ex_m = base.Example("m", "m", "2+2?", 5, "4", meta={"verifier": "math", "record": rows[0]})
  ex_c = base.Example("c", "c", "inc", 5, "", meta={"verifier": "python_tests",
                                                    "record": code})
  got = task.verify_batch([ex_m, ex_c, ex_c, ex_m],
                          ["so \\boxed{4}", "```python\ndef inc(x):\n    return x + 1\n```",
                           "def inc(x): return x", "no answer"])
  assert got == [1.0, 1.0, 0.0, 0.0] and task.num_verify_calls == 4
  bad = base.Example("b", "m", "q", 5, "", meta={"verifier": "math", "record": {"prompt": "q"}})
  assert task.verify(bad, "\\boxed{1}") == 0.0 and task.num_verify_errors == 1


def test_example_files_references_pass_their_verifiers():
  """The shipped examples/ data: every reference response scores 1 under its verifier, and
  each test file shares no prompt with its train file."""
  import os
  from mopd_jax.tasks import verifiers
  here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
  spec = json.load(open(os.path.join(here, "spec.json")))
  for d, b in spec["domains"].items():
    tr, te, counts = records.load_domain(os.path.join(here, b["train"]),
                                         os.path.join(here, b["test"]), b["verifier"])
    v = verifiers.get(b["verifier"])  # the OS sandbox: imports and classes are allowed
    assert all(v(records.reference_response(r.fields), r.fields) == 1.0 for r in tr + te), \
        (d, v.last_error)
    assert counts.train >= 30 and counts.test >= 10


def _to_bucket(gcs_root, local_path, gs_path):
  """Copies a local file to `gs_path` of the stand-in bucket (conftest.py's `gcs`)."""
  import shutil
  target = os.path.join(gcs_root, gs_path[len("gs://"):])
  os.makedirs(os.path.dirname(target), exist_ok=True)
  shutil.copy(local_path, target)
  return gs_path


def test_records_digest_and_dedup_on_object_storage(tmp_path, gcs):
  """The same files read from gs:// give the same records, counts and digest as read
  locally; errors name the gs:// path."""
  train = _jsonl(tmp_path / "train.jsonl", MATH)
  test = _parquet(tmp_path / "test.parquet", [{"prompt": "5-1?", "answer": "4"},
                                              {"prompt": "5-1?", "answer": "4"}])
  gs_train = _to_bucket(gcs, train, "gs://bucket/data/train.jsonl")
  gs_test = _to_bucket(gcs, test, "gs://bucket/data/test.parquet")
  local = records.load_domain(train, test, "math")
  remote = records.load_domain(gs_train, gs_test, "math")
  assert [[r.fields for r in part] for part in remote[:2]] == \
      [[r.fields for r in part] for part in local[:2]]
  assert [r.source for r in remote[0]] == [r.source for r in local[0]]
  assert remote[2] == local[2] and remote[2].train_duplicates == 1
  assert records.fingerprint([gs_train, gs_test]) == records.fingerprint([train, test])
  assert records.fingerprint([gs_train]) != records.fingerprint([gs_test])
  with pytest.raises(base.DataError, match="gs://bucket/data/none.jsonl: no such file"):
    records.read("gs://bucket/data/none.jsonl")
  bad = _to_bucket(gcs, _jsonl(tmp_path / "bad.jsonl", [MATH[0], "{oops"]),
                   "gs://bucket/data/bad.jsonl")
  with pytest.raises(base.DataError, match="gs://bucket/data/bad.jsonl:2: malformed JSON"):
    records.read(bad)


def test_files_spec_on_object_storage(tmp_path, gcs):
  """configs/files.py reads a gs:// spec; its relative paths resolve beside it, absolute and
  gs:// ones stay as they are."""
  from configs import files
  from mopd_jax.tasks import tools
  examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "examples")
  for name in os.listdir(examples):
    _to_bucket(gcs, os.path.join(examples, name), f"gs://bucket/ex/{name}")
  c = files.get_config("gs://bucket/ex/spec.json")
  assert c.tasks.math.train == "gs://bucket/ex/math_train.jsonl"
  assert c.tasks.code.train == "gs://bucket/ex/code.parquet"
  c.model.tokenizer_path = "/ckpt/tokenizer.json"  # build names it; nothing reads it here
  rc = configure.build(c, 1)
  assert rc.records["tool"].test == "gs://bucket/ex/tool_test.jsonl"
  assert rc.tool_markers == tools.MARKERS
  spec = {"domains": {"math": {"verifier": "math", "train": "gs://bucket/ex/math_train.jsonl",
                               "test": os.path.join(examples, "math_test.jsonl")},
                      "code": {"verifier": "python_tests", "train": "code.parquet",
                               "test": "code_test.jsonl"}},
          "efforts": {"low": 0.5, "max": 1.0}}
  _to_bucket(gcs, _jsonl(tmp_path / "spec.json", [spec]), "gs://bucket/other/spec.json")
  c = files.get_config("gs://bucket/other/spec.json")
  assert (c.tasks.math.train, c.tasks.math.test, c.tasks.code.test) == (
      "gs://bucket/ex/math_train.jsonl", os.path.join(examples, "math_test.jsonl"),
      "gs://bucket/other/code_test.jsonl")
  c.model.tokenizer_path = "/ckpt/tokenizer.json"
  assert configure.build(c, 1).tool_markers == ()  # no tool domain: no tool token asked for
  with pytest.raises(ValueError, match="gs://bucket/none.json: cannot read the spec file"):
    files.get_config("gs://bucket/none.json")
