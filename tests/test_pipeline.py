"""The whole pipeline on the smoke config: every stage runs, outputs are where they belong,
re-running skips finished stages, and a subset of stages reuses earlier outputs."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_cli(workdir, *extra):
  """The real entry point in a fresh process with one CPU device (the config's mesh)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/toy.py:fast", "--workdir", workdir, *extra],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  wd = str(tmp_path_factory.mktemp("pipeline"))
  proc = _run_cli(wd)
  assert proc.returncode == 0, proc.stderr[-3000:]
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
  # the toy's phases: policy iteration at max, the budget phases held to pi_SFT
  refs = {n: (t["pmd_reference"], t["lr"], t["tau_kl"]) for n, t in manifest["teachers"].items()}
  assert refs["agt/max"] == ("sampler", 3e-4, 0.5) and refs["cod/low"] == ("sft", 3e-4, 0.2)


def test_rl_phase_settings():
  import ml_collections
  from mopd_jax import rl
  c = ml_collections.ConfigDict(dict(reference="sampler,sft,parent", lr=1e-3, tau_kl=0.5,
                                     anneal_lr=0.0, anneal_tau_kl=0.1, steps_per_effort=20,
                                     anneal_steps=30))
  order = ("max", "high", "low")
  assert [rl.phase_settings(c, e, order) for e in order] == [
      dict(reference="sampler", lr=1e-3, tau_kl=0.5, steps=20),
      dict(reference="sft", lr=1e-3, tau_kl=0.1, steps=30),
      dict(reference="parent", lr=1e-3, tau_kl=0.1, steps=30)]
  assert rl.references("sft", order) == dict(max="sft", high="sft", low="sft")
  # Two values: the first phase, then every budget phase, for any number of phases.
  assert rl.references("sampler,sft", order) == dict(max="sampler", high="sft", low="sft")
  assert rl.references("sampler,sft", ("a", "b")) == dict(a="sampler", b="sft")
  assert rl.references("sampler,sft", ("only",)) == dict(only="sampler")
  assert rl.references("sampler,sft,parent,sft", "abcd") == dict(a="sampler", b="sft",
                                                                 c="parent", d="sft")
  for bad in ("phase", "sampler,sft,sft,sft", "sampler,,sft"):
    with pytest.raises(ValueError, match="rl.reference"):
      rl.references(bad, order)


def test_rl_train_width_is_a_power_of_two_above_the_floor():
  from mopd_jax import rl
  assert [rl.train_width(n, 64) for n in (1, 40, 64, 65, 93, 128, 129)] == \
      [64, 64, 64, 128, 128, 128, 256]
  assert rl.train_width(20, 16) == 32


def test_rl_lane_processes():
  import ml_collections
  from mopd_jax import lanes
  c = lambda k: ml_collections.ConfigDict(dict(lane_processes=k))
  assert lanes.process_count(c(3), 3) == 3
  assert lanes.process_count(c(8), 4) == 4  # never more processes than lanes
  for bad in (0, -1, 1.5):
    with pytest.raises(ValueError, match="rl.lane_processes"):
      lanes.process_count(c(bad), 3)


def test_failed_rl_lane_processes_are_named_with_their_logs(tmp_path):
  """Lanes side by side with no pi_SFT to start from: every lane process fails, and the
  stage names each lane, its exit status and the end of its log (in a fresh process with
  one CPU device, the config's mesh)."""
  code = ("from configs import toy\nfrom mopd_jax import lanes\n"
          "from mopd_jax.stages import context, rl\n"
          f"run = context.Run(toy.get_config('fast'), {str(tmp_path)!r})\n"
          "lanes_ = rl.lanes_of(run)\n"
          "try:\n  lanes.run_side_by_side(run.workdir, run.config.to_json(), lanes_, 3, "
          "[rl.lane_steps(run, lane) for lane in lanes_])\n"
          "except RuntimeError as e:\n  print('RuntimeError:', e)\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300).stdout
  assert "RuntimeError: RL lane(s) failed" in out, out
  for d in ("gen", "agt", "cod"):
    assert f"lane {d} exited with code 1" in out
    assert os.path.exists(tmp_path / "rl" / d / "lane.log")
  assert "sft/params" in out  # the cause, from the logs' tails
  assert not os.path.exists(tmp_path / "teachers.json")


def test_mopd_cell_prompts_shared_or_distinct_across_efforts():
  from mopd_jax import grid as grid_mod, mopd
  from mopd_jax.tasks import TOY_DOMAINS as DOMAINS
  grid = grid_mod.Grid(DOMAINS, tuple(grid_mod.Effort(e, t) for e, t in
                                      (("low", 0.3), ("high", 0.7), ("max", 1.5))))

  def iters(n):
    return {d: iter([[f"{d}{i}" for i in range(n)]]) for d in DOMAINS}

  shared = mopd.cell_prompts(iters(2), grid, 2, shared=True)
  assert len(shared) == 9  # domain-major: (gen, low), (gen, high), (gen, max), (agt, low), ...
  assert shared[0] == shared[1] == shared[2] == ["gen0", "gen1"]
  assert shared[3] == shared[5] == ["agt0", "agt1"]
  distinct = mopd.cell_prompts(iters(6), grid, 2, shared=False)
  assert distinct[:3] == [["gen0", "gen1"], ["gen2", "gen3"], ["gen4", "gen5"]]
  assert distinct[8] == ["cod4", "cod5"]
  # An effort mix: every prompt in exactly one of its domain's cells, efforts as drawn.
  rng = np.random.RandomState(0)
  mixed = mopd.cell_prompts(iters(600), grid, 200, shared=False, mix=(0.0, 1.0, 3.0),
                            rng=rng)
  for i, d in enumerate(DOMAINS):
    low, high, top = mixed[3 * i:3 * i + 3]
    assert low == [] and sorted(high + top) == sorted(f"{d}{j}" for j in range(600))
    assert 0.2 < len(high) / 600 < 0.3  # weight 1 of 4


def test_mopd_stage_with_an_effort_mix(workdir, tmp_path):
  """mopd.effort_mix through the real stage: cells of varying size, every effort drawn."""
  wd = str(tmp_path / "mix")
  shutil.copytree(workdir, wd)
  shutil.rmtree(os.path.join(wd, "mopd"))
  proc = _run_cli(wd, "--config.stages=mopd", "--config.mopd.prompts_across_efforts=distinct",
                  "--config.mopd.prompts_per_cell=2", "--config.mopd.effort_mix=(1.,1.,2.)")
  assert proc.returncode == 0, proc.stderr[-3000:]
  hist = json.load(open(os.path.join(wd, "mopd", "history.json")))
  assert len(hist) == 3 and all(h["num_rows"] == 18 for h in hist)  # 3 domains x 6 prompts
  sizes = [sum(1 for n in h["cells"] if n.endswith("/max")) for h in hist]
  assert max(sizes) >= 2  # max (weight 2) drawn in at least two domains in some step


def test_rl_reward_plateau_rule():
  from mopd_jax import rl
  hist = lambda rewards: [(i, {"reward": r}) for i, r in enumerate(rewards)]
  rising, flat = [0.1, 0.2, 0.3, 0.4], [0.5, 0.52, 0.49, 0.51]
  assert not rl.plateaued(hist(rising), 2, 0.02)  # +0.2 between the two windows
  assert rl.plateaued(hist(flat), 2, 0.02)  # -0.01
  assert not rl.plateaued(hist(flat[:3]), 2, 0.02)  # fewer than two windows yet
  assert not rl.plateaued(hist(flat), 0, 0.02)  # off


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
  assert len(rep["checks"]) == 39 and all(c["ok"] in (True, False) for c in rep["checks"])
  assert rep["grid"]["domains"] == ["gen", "agt", "cod"]
  assert "Expected results of the toy run" in open(
      os.path.join(workdir, "report.md")).read()


def test_report_checks_evaluate_the_bars():
  """Each bar is computed from the cells, the KL curve and the wall times; a missing policy
  leaves its checks undecided (None) rather than failed."""
  from mopd_jax import report
  from mopd_jax.tasks import TOY_DOMAINS
  lengths = {"low": 3.0, "high": 9.0, "max": 19.0}
  cells = []
  for d in TOY_DOMAINS:
    for e, n in lengths.items():
      cells.append({"policy": "sft", "domain": d, "effort": e, "accuracy": 0.5,
                    "mean_length": 19.0, "over_budget_rate": 0.0, "n": 8})
      cells.append({"policy": "teacher", "domain": d, "effort": e,
                    "accuracy": 0.6 if e == "max" else 0.4, "mean_length": n,
                    "over_budget_rate": 0.1 if (d, e) == ("cod", "low") else 0.0, "n": 8})
  grid = {"domains": list(TOY_DOMAINS), "efforts": {"low": 0.3, "high": 0.72, "max": 1.5}}
  rep = {"grid": grid, "cells": cells,
         "kl": {"initial": 2.0, "final": 0.5, "curve": [[0, 2.0], [1, 0.5]]},
         "wall_seconds": {"sft": 300.0, "rl": 400.0, "total": 1300.0}}
  got = {c["name"]: c["ok"] for c in report.checks(rep)}
  assert got["teacher gen/max accuracy - pi_SFT gen/max accuracy"] is True  # +0.10
  assert got["teacher gen mean length low < high < max"] is True
  assert got["teacher cod/low over-budget rate"] is False
  assert got["teacher agt/low over-budget rate"] is True
  assert got["student gen/max accuracy / teacher's"] is None  # no student cells
  assert got["per-token KL, first / last MOPD step"] is False  # a 4x drop
  assert got["teacher factory wall seconds (sft + rl)"] is True
  assert got["pipeline wall seconds"] is False
  assert "x4.0 drop" in report.markdown(rep)
  # The last step's value is a sampled-token estimate and can fall below 0: no ratio is
  # claimed, the bar stays undecided, and the first / last tenths' means are shown.
  curve = [[i, 0.2 - 0.025 * i] for i in range(10)]
  rep["kl"] = {"initial": 0.2, "final": curve[-1][1], "curve": curve}
  assert {c["name"]: c["ok"] for c in report.checks(rep)}[
      "per-token KL, first / last MOPD step"] is None
  md = report.markdown(rep)
  assert "no ratio" in md and "first / last 1 steps 0.2000 / -0.0250" in md, md


def test_rerun_skips_finished_stages(workdir):
  proc = _run_cli(workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("already done") == 6


def test_mopd_stage_with_asynchronous_teacher_scoring(workdir, tmp_path):
  """mopd.staleness=1 (and 3 microbatches) through the real stage: the same steps,
  importance-weighted, with the first (not yet stale) step equal to the synchronous run's."""
  wd = str(tmp_path / "async")
  shutil.copytree(workdir, wd)
  shutil.rmtree(os.path.join(wd, "mopd"))
  proc = _run_cli(wd, "--config.stages=mopd", "--config.mopd.staleness=1",
                  "--config.mopd.microbatches=3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  sync = json.load(open(os.path.join(workdir, "mopd", "history.json")))
  stale = json.load(open(os.path.join(wd, "mopd", "history.json")))
  assert len(stale) == len(sync) == 3
  assert all("is_weight_mean" in h for h in stale) and "is_weight_mean" not in sync[0]
  # Step 0 trains on a batch its own params sampled: weights 1 up to sampler round-off.
  assert stale[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
  assert stale[0]["loss"] == pytest.approx(sync[0]["loss"], rel=1e-3, abs=1e-5)
  done = json.load(open(os.path.join(wd, "mopd", "DONE.json")))
  assert done["staleness"] == 1 and done["phase_seconds_per_step"]["step"] > 0


def test_unknown_stage_is_an_error(workdir):
  proc = _run_cli(workdir, "--config.stages=sft,distill")
  assert proc.returncode != 0 and "unknown stage" in proc.stderr


def test_qwen3_tiny_config_smoke_runs(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path),
                         "--config.stages=smoke"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("sample=") == 3


def test_student_from_hugging_face_checkpoint(tmp_path):
  """`model.hf_path`: the run starts from a safetensors checkpoint written by our exporter."""
  import jax
  import configs.qwen3_mopd as q
  from mopd_jax import config as config_mod, hf
  from mopd_jax.tokenizer import CharTokenizer
  cfg = config_mod.model_config(q.get_config("tiny"), CharTokenizer().vocab_size)
  ckpt = tmp_path / "student"
  hf.save_checkpoint(cfg, jax.device_get(__import__("mopd_jax").models.init_params(
      cfg, jax.random.PRNGKey(3))), str(ckpt))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path / "wd"),
                         "--config.stages=smoke", f"--config.model.hf_path={ckpt}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("sample=") == 3


@pytest.mark.slow  # ~90 s; loading each piece is covered by tests/test_hf.py
def test_teachers_from_hugging_face_checkpoints(tmp_path):
  """`teacher.hf_paths`: nine exported checkpoints of a deeper shape than the student are
  registered instead of trained, and MOPD distils from them."""
  import jax
  import configs.qwen3_mopd as q
  from mopd_jax import config as config_mod, hf, models
  from mopd_jax.tokenizer import CharTokenizer
  cfg = q.get_config("tiny")
  vocab = CharTokenizer().vocab_size
  tcfg = hf.resolve_model_config(cfg.teacher, vocab)
  assert tcfg.num_layers != config_mod.model_config(cfg, vocab).num_layers
  paths = []
  for i in range(9):
    p = tmp_path / f"t{i}"
    hf.save_checkpoint(tcfg, jax.device_get(models.init_params(tcfg, jax.random.PRNGKey(i))),
                       str(p))
    paths.append(str(p))
  # Two devices, teachers disaggregated: the student on device 0, the bank on device 1
  # (placement.TeacherScorer moves trajectories and log-probs between them).
  env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path / "wd"),
                         "--config.stages=data,sft,rl,mopd",
                         "--config.placement.teachers=disaggregated",
                         f"--config.teacher.hf_paths=({','.join(repr(p) for p in paths)})"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  manifest = json.load(open(tmp_path / "wd" / "teachers.json"))
  assert all(t["format"] == "hf" for t in manifest["teachers"].values())
  assert os.path.exists(tmp_path / "wd" / "mopd" / "DONE.json")
