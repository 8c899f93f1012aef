"""Any task grid: domains and efforts from the config (mopd_jax/tasks/grid.py), and every consumer
of the grid (router, report tables, checks and plots, the pipeline) for grids from 1 x 1 to
8 x 4."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from configs import toy
from mopd_jax import configure
from mopd_jax.evaluation import report, report_plots
from mopd_jax.tasks import grid as grid_mod
from mopd_jax.teachers import bank as teachers
import toy_grid
import suite_cli

ROOT = suite_cli.ROOT


def _grid(domains, taus):
  return grid_mod.Grid(tuple(domains), tuple(grid_mod.Effort(e, t) for e, t in taus.items()))


def test_grid_from_config():
  c = toy.get_config("fast")
  g = configure.run_grid(c)
  assert g.domains == ("gen", "agt", "cod") and g.effort_names == ("low", "high", "max")
  assert g.anneal_order == ("max", "high", "low") and g.by_budget == ("low", "high", "max")
  assert g.names == toy_grid.NAMES and len(g.cells) == 9
  assert g.taus == {"low": 0.3, "high": 0.72, "max": 1.5}
  c.domains, c.efforts = "cod, gen", "max,low"  # order and spaces as written
  g = configure.run_grid(c)
  assert g.names == ("cod/max", "cod/low", "gen/max", "gen/low")
  assert g.anneal_order == ("max", "low") and g.top_effort == "max"
  assert grid_mod.Grid.from_json(json.loads(json.dumps(g.to_json()))) == g
  # A domain of another name runs a registered task; an effort is any block with a tau.
  c.tasks.arith = {"task": "gen"}
  c.effort.turbo = {"tau": 3.0}
  c.domains, c.efforts = "arith", "turbo"
  g = configure.run_grid(c)
  assert g.task_of("arith") == "gen" and g.names == ("arith/turbo",)


@pytest.mark.parametrize("field, value, match", [
    ("domains", "gen,math", r"unknown domain\(s\) \['math'\].*known: \['agt', 'cod', 'cod_uniform', 'gen', 'gen_pairs', 'gen_uniform', 'records'\]"),
    ("efforts", "low,medium", r"unknown effort\(s\) \['medium'\].*known: \['high', 'low', "
                              r"'max'\]"),
    ("domains", "gen,,gen", "repeats a name"),
    ("efforts", " , ", "names no entry"),
    ("domains", "gen/x", "not a valid name"),
])
def test_unknown_or_bad_names_raise_before_anything_compiles(field, value, match):
  c = toy.get_config("fast")
  setattr(c, field, value)
  with pytest.raises(ValueError, match=match):
    configure.build(c, 1)


def test_cli_names_the_grid_and_rejects_unknown_names():
  """`--config.domains=... --config.efforts=...` from the command line: an unknown name is one
  line and exit status 2, before any stage."""
  env = suite_cli.env()
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/toy.py:fast", "--workdir", "/nonexistent/never",
                         "--config.domains=gen,cod", "--config.efforts=low,turbo"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("config error: unknown effort(s) ['turbo']") and "known:" in last
  assert "Traceback" not in proc.stderr and not os.path.exists("/nonexistent/never")


def _cells(g, policies=("sft", "teacher", "student")):
  """Synthetic eval cells: length grows with tau, teachers beat pi_SFT at the top effort."""
  rng = np.random.RandomState(0)
  out = []
  for d in g.domains:
    for e in g.effort_names:
      for p in policies:
        acc = 0.9 if p != "sft" or e != g.top_effort else 0.5
        out.append({"policy": p, "domain": d, "effort": e, "accuracy": acc,
                    "mean_length": 10.0 * g.taus[e] + rng.rand() * 0.1,
                    "over_budget_rate": 0.0, "n": 8})
  return out


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 2), (8, 4)])
def test_report_tables_checks_and_plots_for_any_grid(tmp_path, shape):
  nd, ne = shape
  g = _grid([f"d{i}" for i in range(nd)], {f"e{j}": 0.25 * (j + 1) for j in range(ne)})
  rep = {"grid": g.to_json(), "cells": _cells(g),
         "kl": {"initial": 1.0, "final": 0.1, "curve": [[0, 1.0], [1, 0.1]]},
         "kl_per_cell": {n: [[0, 1.0], [1, 0.1]] for n in g.names},
         "reward_curve": [[0, -1.0], [1, -0.1]],
         "wall_seconds": {"sft": 1.0, "rl": 1.0, "total": 3.0}}
  rep["checks"] = report.checks(rep)
  got = {c["name"]: c["ok"] for c in rep["checks"]}
  top = g.top_effort
  assert got[f"teacher d0/{top} accuracy - pi_SFT d0/{top} accuracy"] is True
  if ne > 1:
    assert got[f"student d{nd - 1} mean length {' < '.join(g.by_budget)}"] is True
  else:  # one effort: no length order to check
    assert not any("mean length e0" in n for n in got)
  assert sum(n.endswith("over-budget rate") for n in got) == nd * ne
  assert sum(n.endswith("accuracy / teacher's") for n in got) == nd * ne
  md = report.markdown(rep)
  rows = [line for line in md.splitlines() if line.startswith("| d") and "domain" not in line]
  assert len(rows) == nd * ne and rows[0].startswith("| d0 | e0 |")
  written = report_plots.plots(rep, str(tmp_path), policies=report.POLICIES)
  assert [os.path.basename(p) for p in written] == ["cells.png", "kl.png", "length.png"]
  assert all(os.path.getsize(p) > 1000 for p in written)
  router = teachers.Router(g.names)
  assert router.index(f"d{nd - 1}", f"e{ne - 1}") == nd * ne - 1


def _run_grid(tmp_path, domains, efforts, *extra):
  env = suite_cli.env()
  wd = tmp_path / "run"
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/toy.py:tiny", "--workdir", str(wd),
                         f"--config.domains={domains}", f"--config.efforts={efforts}", *extra],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return wd


@pytest.mark.parametrize("domains, efforts", [
    pytest.param("cod", "max", marks=pytest.mark.slow),  # the 2 x 2 below is the guard
    ("gen,cod", "low,max"),  # skips a domain and an effort of the toy's 3 x 3
    pytest.param("gen,agt,cod", "low,max", marks=pytest.mark.slow)])
def test_pipeline_runs_every_stage_on_a_sub_grid(tmp_path, domains, efforts):
  """1 x 1, 2 x 2 and 3 x 2 grids through every stage (the tiny toy config): teachers,
  manifest, eval cells and report hold exactly the grid's cells (the 1 x 1 run also evaluates
  2 sampled responses per example)."""
  one = "," not in domains + efforts
  wd = _run_grid(tmp_path, domains, efforts, *(["--config.eval.samples=2"] if one else []))
  d, e = domains.split(","), efforts.split(",")
  names = {f"{x}/{y}" for x in d for y in e}
  manifest = json.load(open(wd / "teachers.json"))
  assert set(manifest["teachers"]) == names
  assert manifest["grid"]["domains"] == d and [n for n, _ in manifest["grid"]["efforts"]] == e
  rep = json.load(open(wd / "report.json"))
  for policy in ("sft", "teacher", "student"):
    assert {f"{c['domain']}/{c['effort']}" for c in rep["cells"]
            if c["policy"] == policy} == names, policy
  assert len(rep["cells"]) == 3 * len(names)
  for c in rep["cells"]:
    assert c["p90_length"] >= 0 and ("sample_accuracy" in c) == one, c
    if one:
      assert 0.0 <= c["sample_accuracy"] <= 1.0
  hist = json.load(open(wd / "mopd" / "history.json"))
  assert set(hist[0]["cells"]) == names
  # The vocabulary follows the efforts: a student of this grid has one effort token each.
  assert rep["grid"]["efforts"] == manifest["grid"]["efforts"]
  # The same workdir on another grid: the manifest's grid is not this run's.
  shutil.rmtree(wd / "mopd")
  env = suite_cli.env()
  other = "gen" if domains != "gen" else "cod"
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/toy.py:tiny", "--workdir", str(wd), "--config.stages=mopd",
                         f"--config.domains={other}", f"--config.efforts={efforts}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "holds teachers trained on the" in proc.stderr, \
      proc.stderr[-2000:]
