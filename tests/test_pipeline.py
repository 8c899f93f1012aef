"""The whole pipeline on the smoke config: every stage runs, outputs are where they belong,
re-running skips finished stages, and a subset of stages reuses earlier outputs."""
import json
import os

import pytest

from configs import toy
from mopd_jax import pipeline


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("pipeline"))
  pipeline.run(toy.get_config("fast"), wd)
  return wd


def test_every_stage_leaves_its_outputs(workdir):
  for stage in ("data", "sft", "rl", "mopd", "eval", "report"):
    assert os.path.exists(os.path.join(workdir, stage, "DONE.json")), stage
  manifest = json.load(open(os.path.join(workdir, "teachers.json")))
  assert len(manifest["teachers"]) == 9
  for name, t in manifest["teachers"].items():
    assert {"domain", "effort", "tau", "step", "parent", "config_hash",
            "eval_validation"} <= set(t), name
  assert manifest["teachers"]["gen/high"]["parent"].endswith("teacher_max")
  assert manifest["teachers"]["gen/low"]["parent"].endswith("teacher_high")


def test_report_schema(workdir):
  rep = json.load(open(os.path.join(workdir, "report.json")))
  policies = {(c["policy"], c["domain"], c["effort"]) for c in rep["cells"]}
  assert len(policies) == 27  # sft, teacher and student in all 9 cells
  for c in rep["cells"]:
    assert {"accuracy", "mean_length", "over_budget_rate", "n"} <= set(c)
    assert 0.0 <= c["accuracy"] <= 1.0
  assert rep["kl"]["initial"] is not None and len(rep["kl"]["curve"]) == 3
  assert "total" in rep["wall_seconds"] and rep["config"]["seed"] == 0
  for png in ("cells.png", "kl.png", "length.png"):
    assert os.path.getsize(os.path.join(workdir, png)) > 1000


def test_rerun_skips_finished_stages(workdir, capsys):
  timings = pipeline.run(toy.get_config("fast"), workdir)
  assert timings == {}
  assert "already done" in capsys.readouterr().out


def test_unknown_stage_is_an_error(workdir):
  cfg = toy.get_config("fast")
  cfg.stages = "sft,distill"
  with pytest.raises(ValueError, match="unknown stage"):
    pipeline.run(cfg, workdir)
