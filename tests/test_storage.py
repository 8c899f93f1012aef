"""Workdir files on object storage (mopd_jax/io/storage.py), without a network.

A `gs://` filesystem is served from a local folder (the `gcs` fixture of conftest.py: an
fsspec implementation registered for the gs / gcs protocols, which `etils.epath`, and so
`mopd_jax.io.storage`, then uses). The pipeline's own file handling runs on it: DONE markers,
JSON files and manifests, lane records and logs, metrics (JSONL and TensorBoard), the report
and its plots, and the bookkeeping that moves an unreadable checkpoint step aside. Orbax's
own `gs://` path goes through tensorstore's network driver, which this cannot redirect, so
orbax checkpoints are not part of it; a real bucket is not tested here either.
"""
import ast
import json
import os
import pathlib

import pytest

from mopd_jax.evaluation import report
from mopd_jax.io import checkpoint, metrics, storage
from mopd_jax.stages import lanes
from mopd_jax.tasks.grid import Effort, Grid

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_storage_primitives_on_object_storage(gcs):
  wd = "gs://bucket/run"
  assert storage.is_remote(wd) and storage.join(wd, "a", "b.json") == "gs://bucket/run/a/b.json"
  storage.write_json(storage.join(wd, "a", "b.json"), {"x": [1, 2]})
  assert storage.read_json(storage.join(wd, "a", "b.json")) == {"x": [1, 2]}
  assert json.load(open(os.path.join(gcs, "bucket", "run", "a", "b.json"))) == {"x": [1, 2]}
  assert storage.read_json(storage.join(wd, "none.json"), default={"d": 1}) == {"d": 1}
  with pytest.raises(FileNotFoundError, match="gs://bucket/run/none.json"):
    storage.read_json(storage.join(wd, "none.json"))
  storage.append_text(storage.join(wd, "log.txt"), "one\n")
  storage.append_text(storage.join(wd, "log.txt"), "two\n")
  assert storage.read_text(storage.join(wd, "log.txt")) == "one\ntwo\n"
  storage.rename(storage.join(wd, "a"), storage.join(wd, "aside", "a-1"))
  assert storage.listdir(wd) == ["aside", "log.txt"] and storage.isdir(storage.join(wd, "aside"))
  storage.rmtree(storage.join(wd, "aside"))
  assert not storage.exists(storage.join(wd, "aside"))


def test_local_writes_replace_atomically(tmp_path):
  target = tmp_path / "x.json"
  storage.write_json(target, {"v": 1})
  storage.write_json(target, {"v": 2})
  assert json.load(open(target)) == {"v": 2} and os.listdir(tmp_path) == ["x.json"]


def test_pipeline_files_on_a_gs_workdir(gcs, tmp_path):
  wd = "gs://bucket/run"
  local = os.path.join(gcs, "bucket", "run")
  # DONE markers and JSON through checkpoint (what every stage writes).
  checkpoint.write_json(storage.join(wd, "sft", "DONE.json"), {"steps": 3})
  assert checkpoint.read_json(storage.join(wd, "sft", "DONE.json")) == {"steps": 3}
  # Metrics: JSONL and TensorBoard events through the local mirror.
  log = metrics.MetricsLogger(storage.join(wd, "tb", "mopd"), enabled=True)
  for step in range(3):
    log.scalars(step, {"loss": 1.0 / (step + 1), "kl": 0.5})
  log.close()
  rows = [json.loads(line) for line in open(os.path.join(local, "tb", "mopd", "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert any(n.startswith("events.out.tfevents") for n in os.listdir(
      os.path.join(local, "tb", "mopd")))
  # Lane records and logs.
  lane = type("Lane", (), dict(directory=storage.join(wd, "rl", "gen"), domain="gen",
                               efforts=("max",), name="gen"))()
  checkpoint.write_json(storage.join(lane.directory, lanes.RECORDS), {"gen/max": {"step": 2}})
  assert lanes.read_records(lane) == {"gen/max": {"step": 2}}
  assert not lanes._finished(lane)  # pylint: disable=protected-access  (no teacher_max yet)
  storage.makedirs(storage.join(lane.directory, "teacher_max"))
  storage.write_text(storage.join(lane.directory, "teacher_max", "x"), "params")
  assert lanes._finished(lane)  # pylint: disable=protected-access
  mirror = storage.LocalMirror(lane.directory)
  with open(os.path.join(mirror.local, lanes.LOG), "a") as f:
    f.write("lane output\n")
  assert lanes._tail(mirror) == "lane output\n"  # pylint: disable=protected-access
  mirror.close()
  assert open(os.path.join(local, "rl", "gen", lanes.LOG)).read() == "lane output\n"
  # The report: JSON, markdown and PNG plots written through storage.
  g = Grid(("gen", "cod"), (Effort("low", 0.3), Effort("max", 1.5)), ("gen", "cod"))
  cells = [{"policy": p, "domain": d, "effort": e, "accuracy": 0.5, "n": 4,
            "mean_length": 10.0 * g.taus[e] + k, "over_budget_rate": 0.0}
           for k, p in enumerate(("sft", "teacher", "student")) for d, e in g.cells]
  checkpoint.write_json(storage.join(wd, "eval.json"), {"cells": cells})
  history = [{"step": s, "kl": 1.0 / (s + 1), "reward_mean": -0.1,
              "cells": {n: {"kl": 0.5} for n in g.names}} for s in range(3)]
  checkpoint.write_json(storage.join(wd, "mopd", "history.json"), history)
  rep = report.write(wd, {"seed": 0}, {"sft": 1.0, "total": 2.0}, grid=g)
  assert len(rep["cells"]) == 12
  for name in ("report.json", "report.md", "cells.png", "kl.png", "length.png"):
    assert os.path.getsize(os.path.join(local, name)) > 100, name
  assert open(os.path.join(local, "cells.png"), "rb").read(4) == b"\x89PNG"


def test_unreadable_step_is_moved_aside_on_object_storage(gcs):
  """TrainLoop's resume bookkeeping: the rename that sets an unreadable step aside."""
  directory = storage.path("gs://bucket/run/sft/ckpt")
  storage.write_text(directory / "3" / "state" / "junk", "corrupt")
  loop = checkpoint.TrainLoop.__new__(checkpoint.TrainLoop)
  loop.directory = directory
  loop._mgr = type("M", (), {"reload": lambda self: None})()  # pylint: disable=protected-access
  aside = loop._set_aside(3)  # pylint: disable=protected-access
  assert aside.startswith("gs://bucket/run/sft/ckpt.unreadable/3-")
  assert not storage.exists(directory / "3")
  assert os.listdir(os.path.join(gcs, "bucket", "run", "sft", "ckpt.unreadable"))


# Modules that may touch the OS filesystem directly, and why: the storage layer itself; the
# user's model / tokenizer / data files and the sandbox's private temp dirs, which are not
# workdir paths.
OS_FILES_ALLOWED = {"io/storage.py": "the abstraction", "io/hf/config_json.py": "model directories",
                    "io/hf/files.py": "model directories", "io/hf/export.py": "model directories",
                    "io/tokenizer.py": "tokenizer files", "io/tokenizer_files.py": "tokenizer files",
                    "tasks/sandbox/backends.py": "sandbox temp dirs",
                    "tasks/jsonl.py": "the user's data files",
                    "tasks/records.py": "the user's data files"}
FORBIDDEN = {("os", "replace"), ("os", "rename"), ("os", "remove"), ("os", "makedirs"),
             ("os", "listdir"), ("os", "unlink"), ("os", "mkdir"), ("os", "scandir"),
             ("os", "walk")}


def test_no_direct_filesystem_calls_on_workdir_paths():
  """Every `open`, `os.path.*`, os file function, `shutil.*` or `glob.*` call in mopd_jax/
  goes through mopd_jax.io.storage, except in the modules above and on lines marked
  `# local:` (a local mirror folder, by construction not the workdir)."""
  bad = []
  for path in sorted((ROOT / "mopd_jax").rglob("*.py")):
    rel = path.relative_to(ROOT / "mopd_jax").as_posix()
    if rel in OS_FILES_ALLOWED:
      continue
    lines = path.read_text().splitlines()
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.Call):
        continue
      f, hit = node.func, None
      if isinstance(f, ast.Name) and f.id == "open":
        hit = "open"
      elif isinstance(f, ast.Attribute):
        chain = []
        v = f
        while isinstance(v, ast.Attribute):
          chain.insert(0, v.attr)
          v = v.value
        if isinstance(v, ast.Name):
          chain.insert(0, v.id)
          if chain[:2] == ["os", "path"] or chain[0] in ("shutil", "glob") or \
              tuple(chain[:2]) in FORBIDDEN:
            hit = ".".join(chain)
      if hit and "# local:" not in lines[node.lineno - 1]:
        bad.append(f"mopd_jax/{rel}:{node.lineno}: {hit}")
  assert not bad, "direct filesystem calls (use mopd_jax.io.storage):\n" + "\n".join(bad)
