"""The report's expected-result checks and markdown (mopd_jax/evaluation/report.py), and the seed
sweep's summary (mopd_jax/evaluation/sweep_report.py)."""
import numpy as np
import pytest


def test_report_checks_evaluate_the_bars():
  """Each bar is computed from the cells, the KL curve and the wall times; a missing policy
  leaves its checks undecided (None) rather than failed."""
  from mopd_jax.evaluation import kl_curves, report
  from toy_grid import DOMAINS as TOY_DOMAINS
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
  # Only the sampled log-ratio measured: its drop (4x) is shown under its own name, not
  # judged against the exact KL's bar (whose row would claim pi_SFT's exact KL).
  assert report.KL_DROP_CHECK not in got and got[report.KL_DROP_SAMPLED_ROW] is None
  assert [c["value"] for c in report.checks(rep)
          if c["name"] == report.KL_DROP_SAMPLED_ROW] == [pytest.approx(4.0)]
  assert got["teacher factory wall seconds (sft + rl)"] is True
  assert got["pipeline wall seconds"] is False
  assert "the last tenth of the MOPD steps): x4.0" in " ".join(report.markdown(rep).split())
  # The compile seconds of each stage and lane process, beside the wall seconds.
  rep["compile_seconds"] = {"sft": {"seconds": 12.8, "programs": 13},
                            "rl lane agt": {"seconds": 57.8, "programs": 237, "wall": 183.9},
                            "report": {"seconds": 0.0, "programs": 0}}
  md = " ".join(report.markdown(rep).split())
  assert "the run's cache): sft 13 s (13 programs), rl lane agt 58 s (237 programs, of its " \
      "184 s)." in md, md
  rep["clip_frac_curve"] = [[0, 0.02], [1, 0.0]]
  assert "Reward clipped at +-r_max on 1.00% of the generated tokens (mean over the 2 MOPD " \
      "steps; largest step 2.00%)" in " ".join(report.markdown(rep).split())
  del rep["clip_frac_curve"]
  # The last step's value is a sampled-token estimate and can fall below 0: no ratio is
  # claimed, the bar stays undecided, and the first / last tenths' means are shown.
  curve = [[i, 0.2 - 0.025 * i] for i in range(10)]
  rep["kl"] = {"initial": 0.2, "final": curve[-1][1], "curve": curve}
  assert {c["name"]: c["ok"] for c in report.checks(rep)}[report.KL_DROP_SAMPLED_ROW] is None
  md = report.markdown(rep)
  assert "no ratio" in md and "first / last 1 steps 0.2000 / -0.0250" in md, md
  # Where the exact KL was measured the bar reads it, averaged over a tenth of the measured
  # steps at each end: a single noisy last step (0.09 here) does not decide it.
  exact = [[5 * i, 0.5] for i in range(3)] + [[5 * i, 0.2] for i in range(3, 27)] + [
      [5 * i, 0.05] for i in range(27, 29)] + [[145, 0.09]]
  rep["kl_exact_curve"] = exact
  assert kl_curves.kl_drop(rep) == (pytest.approx(0.5 / ((0.05 + 0.05 + 0.09) / 3)), "exact")
  assert {c["name"]: c["ok"] for c in report.checks(rep)}[report.KL_DROP_CHECK] is True
  assert "the exact KL, the first tenth's over the last tenth of the MOPD steps): x7.9" \
      in " ".join(report.markdown(rep).split())
  # With the teacher-SFT init the distillation starts at pi_SFT: its exact KL before the init
  # (mopd/start.json) is the start of the drop.
  rep["kl_start"] = {"policy": "sft", "kl_exact": 1.9, "cells": {}}
  assert kl_curves.kl_drop(rep) == (pytest.approx(1.9 / ((0.05 + 0.05 + 0.09) / 3)),
                                 "exact, from pi_SFT before the teacher-SFT init")
  md = " ".join(report.markdown(rep).split())
  assert "Exact per-token KL of pi_SFT as trained, where the student starts (at " \
      "`mopd.start_temperature`) before its teacher-SFT initialisation, on its own rollouts of the first step's prompts: 1.9000." in md
  assert "the exact KL, pi_SFT's before the teacher-SFT init over the last tenth of the " \
      "MOPD steps): x30.0" in md, md
  # The MOPD stage measures every third step and each of the last tenth's: the windows are
  # tenths of the steps, so the end averages the 6 steps of a 60-step run, not the last two
  # measured points (one of which, a rollout's excursion, can double the mean).
  exact = [[s, 0.2] for s in range(0, 54, 3)] + [[s, 0.02] for s in range(54, 59)] + [[59, 0.2]]
  rep["kl_exact_curve"] = exact
  assert kl_curves.kl_windows(exact)[1].tolist() == [0.02] * 5 + [0.2]
  assert kl_curves.kl_drop(rep)[0] == pytest.approx(1.9 / ((5 * 0.02 + 0.2) / 6))
  md = " ".join(report.markdown(rep).split())
  assert "mean over the first / last tenth of the steps (2 / 6 measured) 0.2000 / 0.0500, " \
      "the last tenth's standard error 0.0300" in md, md
  # The eval's held-out measure (eval.kl_rollouts): pi_SFT, the initialised and the final
  # student, each with its error; the init's and the on-policy drops are expected results,
  # with "no cell rises by more than 2 standard errors".
  def held(kl, se, cells):
    return {"kl_exact": kl, "kl_exact_se": se, "rollouts": 1152,
            "cells": {c: {"kl_exact": k, "kl_exact_se": e} for c, (k, e) in cells.items()}}
  rep["kl_heldout"] = {
      "sft": held(0.2, 0.01, {"gen/low": (0.2, 0.01), "gen/max": (0.2, 0.01)}),
      "init": held(0.025, 0.002, {"gen/low": (0.02, 0.002), "gen/max": (0.03, 0.002)}),
      "student": held(0.01, 0.001, {"gen/low": (0.001, 0.0005), "gen/max": (0.0365, 0.002)})}
  assert kl_curves.kl_drop(rep)[1] != "exact, held-out"
  from mopd_jax.evaluation import agreement
  ratio, se = agreement.heldout_drop(rep["kl_heldout"])  # pi_SFT / the final student
  assert ratio == pytest.approx(20.0) and se == pytest.approx(20.0 * np.hypot(0.05, 0.1))
  assert agreement.heldout_drop(rep["kl_heldout"], "sft", "init")[0] == pytest.approx(8.0)
  assert agreement.on_policy_start(rep["kl_heldout"]) == "init"
  # gen/max rises by 0.0065 > 2 * hypot(0.002, 0.002) = 0.00566; gen/low falls.
  assert agreement.rising_cells(rep["kl_heldout"], "init") == ["gen/max"]
  got = {c["name"]: (c["value"], c["ok"]) for c in report.checks(rep)}
  assert got[report.INIT_DROP_CHECK][1] is True  # x8.0 >= 5
  assert got[report.ON_POLICY_DROP_CHECK][0][0] == pytest.approx(2.5)
  assert got[report.ON_POLICY_DROP_CHECK][1] is True  # x2.5 >= 2
  assert got[report.RISING_CHECK] == (["gen/max"], False)
  md = " ".join(report.markdown(rep).split())
  assert "each policy's own rollouts of 1152 test prompts (± standard error): pi_SFT 0.2000 ± " \
      "0.0100, the initialised student 0.0250 ± 0.0020, the final student 0.0100 ± 0.0010." in md
  assert "the init's drop: pi_SFT / the initialised student = x8.00" in md, md
  assert "the on-policy drop: the initialised student / the final student = x2.50" in md, md
  # Without an init (mopd.init=sft) the on-policy steps start at pi_SFT.
  del rep["kl_heldout"]["init"]
  got = {c["name"]: (c["value"], c["ok"]) for c in report.checks(rep)}
  assert got[report.INIT_DROP_CHECK] == (None, None)
  assert got[report.ON_POLICY_DROP_CHECK][0][0] == pytest.approx(20.0)
  rep["kl_heldout"]["student"]["kl_exact"] = 0.0
  assert agreement.heldout_drop(rep["kl_heldout"]) is None


def test_outside_teacher_accuracy_is_compared_with_the_teacher_it_replaces():
  """`teacher.outside_cell`: the manifest keeps the replaced same-origin teacher under
  `same_origin`; the report puts both validation accuracies side by side and checks that
  they are within 10 points."""
  from mopd_jax.evaluation import report

  def manifest(outside_acc):
    acc = lambda a: {"eval_validation": {"accuracy": a, "mean_length": 9.0}}
    return {"teachers": {"cod/max": {"origin": "outside", **acc(outside_acc)},
                         "gen/max": acc(0.9)},
            "same_origin": {"cod/max": acc(0.95)}}

  assert report.outside_vs_same(manifest(0.9)) == {
      "cod/max": {"outside_accuracy": 0.9, "same_accuracy": 0.95}}
  assert report.outside_vs_same({"teachers": {"cod/max": {}}}) == {}  # no ablation
  grid = {"domains": ["cod"], "efforts": [["max", 1.5]]}
  for acc, ok in ((0.9, True), (0.85, True), (0.8, False)):
    rep = {"grid": grid, "cells": [], "wall_seconds": {},
           "kl": {"curve": [], "initial_by_cell": {"cod/max": {"kl": 0.3, "origin": "outside"}},
                  "initial_by_origin": {"outside": 0.3},
                  "outside_vs_same": report.outside_vs_same(manifest(acc))}}
    got = {c["name"]: c["ok"] for c in report.checks(rep)}
    assert got["outside teacher cod/max validation accuracy - same-origin teacher's"] is ok, acc
  assert "The outside `cod/max` teacher answers 0.800 of the validation prompts, the " \
      "same-origin teacher it replaces 0.950" in " ".join(report.markdown(rep).split())


def test_a_teacher_of_another_tokenizer_is_not_judged_against_this_runs_pi_sft():
  """The teacher's gain over pi_SFT: judged where the teacher was made from this run's
  pi_SFT; shown, not judged, where it is of another tokenizer (made by RL from its own
  factory's pi_SFT, whose report judges it)."""
  from mopd_jax.evaluation import report
  grid = {"domains": ["gen", "cod"], "efforts": [["max", 1.5]]}
  cells = [{"policy": p, "domain": d, "effort": "max", "accuracy": a, "mean_length": 9.0,
            "over_budget_rate": 0.0, "n": 8}
           for d in ("gen", "cod") for p, a in (("sft", 1.0), ("teacher", 0.9))]
  origin = {"gen/max": "other tokenizer", "cod/max": "same"}
  rep = {"grid": grid, "cells": cells, "wall_seconds": {},
         "kl": {"curve": [], "initial_by_cell": {c: {"kl": 0.2, "origin": o}
                                                 for c, o in origin.items()}}}
  got = {c["name"]: c for c in report.checks(rep)}
  gen, cod = (got[f"teacher {d}/max accuracy - pi_SFT {d}/max accuracy"] for d in ("gen", "cod"))
  assert gen["ok"] is None and gen["value"] == pytest.approx(-0.1)
  assert gen["target"] == report.OTHER_PARENT
  assert cod["ok"] is False and cod["target"] == ">= 0.10"


def _seed_report(acc: float, ok: bool):
  from toy_grid import DOMAINS as TOY_DOMAINS
  grid = {"domains": list(TOY_DOMAINS[:1]), "efforts": [["low", 0.3], ["max", 1.5]]}
  cells = [{"policy": p, "domain": "gen", "effort": e, "accuracy": acc, "mean_length": 10.0,
            "over_budget_rate": 0.0, "n": 8} for p in ("sft", "teacher") for e in ("low", "max")]
  return {"grid": grid, "cells": cells, "kl": {"initial": 1.0, "final": 0.1,
                                               "curve": [[0, 1.0], [1, 0.1]]},
          "checks": [{"name": "a bar", "target": ">= 1", "ok": ok, "value": 1.0}]}


def test_sweep_means_spreads_and_checks_per_seed():
  import pytest
  from mopd_jax.evaluation import sweep_report
  sw = sweep_report.sweep({0: _seed_report(0.5, True), 1: _seed_report(0.7, False),
                     2: _seed_report(0.9, True)})
  cell = next(c for c in sw["cells"] if (c["policy"], c["effort"]) == ("teacher", "max"))
  assert cell["seeds"] == 3 and cell["accuracy"]["values"] == [0.5, 0.7, 0.9]
  assert cell["accuracy"]["mean"] == pytest.approx(0.7)
  assert cell["accuracy"]["std"] == pytest.approx(((0.04 + 0 + 0.04) / 3) ** 0.5)
  assert sw["checks"]["a bar"] == {"target": ">= 1", "met": [0, 2], "missed": [1],
                                   "undecided": []}
  md = sweep_report.sweep_markdown(sw)
  assert "| gen | max | 0.700 ± 0.163 | 10.0 ± 0.0 | 0.700 ± 0.163 |" in md
  assert "Expected results met on every seed: 0 of 1." in md and "| a bar | >= 1 | 0, 2 | 1 |" in md
  assert sw["kl_drop"]["1"] == {"ratio": pytest.approx(10.0), "source": "sampled"}
  assert "seed 0 x10.0 (sampled), seed 1 x10.0 (sampled)" in md
  assert sw["kl_heldout_drop"] == {} and "Held-out KL drop" not in md
  held = {0: _seed_report(0.5, True), 1: _seed_report(0.7, True)}
  held[1]["kl_heldout"] = {"sft": {"kl_exact": 0.3, "kl_exact_se": 0.0},
                           "student": {"kl_exact": 0.03, "kl_exact_se": 0.003}}
  sw = sweep_report.sweep(held)
  assert sw["kl_heldout_drop"] == {"1": {"ratio": pytest.approx(10.0), "se": pytest.approx(1.0)}}
  assert "Held-out KL drop per seed (" in sweep_report.sweep_markdown(sw)
  assert "informational): seed 1 x10.0 ± 1.0." in sweep_report.sweep_markdown(sw)
  # Each seed's count of expected results without the wall-time rows, and its stage times.
  walled = {s: _seed_report(0.5, ok) for s, ok in ((0, True), (1, False))}
  for s, rep in walled.items():
    rep["checks"].append({"name": "pipeline wall seconds", "target": "<= 600", "ok": False,
                          "value": 700.0})
    rep["wall_seconds"] = {"sft": 100.0 + s, "total": 700.0}
  sw = sweep_report.sweep(walled)
  assert sw["per_seed"]["0"] == {"met": 1, "of": 1, "missed": [],
                                 "wall_seconds": {"sft": 100.0, "total": 700.0}}
  assert sw["per_seed"]["1"]["met"] == 0 and sw["per_seed"]["1"]["missed"] == ["a bar"]
  md = sweep_report.sweep_markdown(sw)
  assert "| 0 | 1 of 1 | - | 100 | 700 |" in md and "| 1 | 0 of 1 | a bar | 101 | 700 |" in md
  other = _seed_report(0.5, True)
  other["grid"]["efforts"] = [["max", 1.5]]
  with pytest.raises(ValueError, match="different grids"):
    sweep_report.sweep({0: _seed_report(0.5, True), 1: other})


def test_sweep_command(tmp_path, monkeypatch, capsys):
  import pytest
  from experiments import sweep
  from mopd_jax.io import checkpoint
  for args in (["--config", "configs/toy.py", "--workdir", str(tmp_path), "--seeds", "0,x"],
               ["--config", "configs/toy.py", "--workdir", str(tmp_path), "--config.seed=3"],
               ["--config", "configs/toy.py", "--workdir", str(tmp_path), "stray"]):
    with pytest.raises(SystemExit) as e:
      sweep.parse(args)
    assert e.value.code == 2
  for s, acc in ((0, 0.5), (2, 0.9)):  # seed 1 never finished
    checkpoint.write_json(str(tmp_path / f"seed_{s}" / "report.json"), _seed_report(acc, True))
  calls = []

  def fake_run(cmd, check):  # seed 0 runs, seed 1 fails: the sweep stops and summarises
    calls.append(cmd)
    return type("P", (), {"returncode": 0 if "--config.seed=0" in cmd else 3})()
  monkeypatch.setattr(sweep.subprocess, "run", fake_run)
  assert sweep.main(["--config", "configs/toy.py:fast", "--seeds", "0,1,2", "--workdir",
                     str(tmp_path), "--config.mopd.steps=5"]) == 3
  assert len(calls) == 2 and "--config.mopd.steps=5" in calls[0]
  assert calls[1][-3:] == ["--config.seed=1", "--workdir", str(tmp_path / "seed_1")]
  sw = checkpoint.read_json(str(tmp_path / "sweep.json"))
  assert sw["seeds"] == [0, 2] and (tmp_path / "sweep.md").exists()
  assert sweep.main(["--config", "configs/toy.py", "--seeds", "0,2", "--workdir",
                     str(tmp_path), "--summarize-only"]) == 0


def test_report_per_cell_kl_drop_standard_errors_and_diagnostics(tmp_path):
  """report.json: each eval cell's binomial standard error sqrt(p(1-p)/n); each cell's exact
  KL drop, reduced like the run's (first over last tenth of its measured steps); the effort
  sensitivity and loss shares of the measured steps. report.md shows them, start vs end,
  and the expected results do not count the per-cell drops."""
  from mopd_jax.evaluation import report
  from mopd_jax.io import checkpoint
  from mopd_jax.tasks.grid import Effort, Grid
  grid = Grid(("gen",), (Effort("low", 0.3), Effort("high", 0.7), Effort("max", 1.5)))
  cells = [{"policy": p, "domain": "gen", "effort": e, "accuracy": 0.8, "mean_length": 9.0,
            "over_budget_rate": 0.0, "n": 100} for p in report.POLICIES for e in ("low", "max")]
  checkpoint.write_json(str(tmp_path / "eval.json"), {"cells": cells})
  history = []
  for s in range(20):
    rec = {"step": s, "kl": 1.0, "reward_mean": 0.0, "kl_exact": 1.0 / (s + 1),
           "cells": {"gen/low": {"kl": 1.0, "kl_exact": 2.0 / (s + 1)},
                     "gen/max": {"kl": 1.0, "kl_exact": 0.5 if s < 10 else -0.1}}}
    if s in (0, 19):  # the diagnostics' measured steps
      rec.update({"effort_kl/low-high": 0.3 if s == 0 else 0.1, "effort_kl/high-max": 0.2,
                  "grad_norm_seq": 2.0, "grad_norm_tok": 1.0})
      for n, share in (("gen/low", 0.25), ("gen/max", 0.75)):
        rec["cells"][n].update({"effort_kl/low-high": share, "token_share": share,
                                "seq_weight_share": 0.5, "grad_share_seq": 0.5,
                                "grad_share_tok": share, "grad_norm_seq": 1.5,
                                "grad_norm_tok": share})
    history.append(rec)
  checkpoint.write_json(str(tmp_path / "mopd" / "history.json"), history)
  rep = report.build(str(tmp_path), {}, {}, grid=grid)
  assert all(c["accuracy_se"] == pytest.approx((0.8 * 0.2 / 100) ** 0.5) for c in rep["cells"])
  drop = rep["kl_exact_drop_per_cell"]
  assert drop["gen/low"] == {"first": pytest.approx(2.0 * (1 + 1 / 2) / 2),
                             "last": pytest.approx(2.0 * (1 / 19 + 1 / 20) / 2), "n": 2,
                             "drop": pytest.approx((1 + 1 / 2) / (1 / 19 + 1 / 20))}
  assert drop["gen/max"]["drop"] is None  # the last tenth's mean is below 0: no ratio
  assert rep["effort_kl"]["curve"] == {"effort_kl/low-high": [[0, 0.3], [19, 0.1]],
                                       "effort_kl/high-max": [[0, 0.2], [19, 0.2]]}
  assert rep["effort_kl"]["per_cell"]["gen/max"] == {"effort_kl/low-high": [[0, 0.75],
                                                                            [19, 0.75]]}
  assert rep["loss_shares"]["curve"] == {"grad_norm_seq": [[0, 2.0], [19, 2.0]],
                                         "grad_norm_tok": [[0, 1.0], [19, 1.0]]}
  assert rep["loss_shares"]["per_cell"]["gen/low"]["token_share"] == [[0, 0.25], [19, 0.25]]
  rep["wall_seconds"] = {}
  rep["checks"] = report.checks(rep)
  # The per-cell KL drops over the MOPD steps are informational; the one per-cell KL result
  # is the held-out "no cell rises" row, undecided without the eval's held-out KL.
  cell_kl = [c for c in rep["checks"] if "cell" in c["name"] and "KL" in c["name"]]
  assert [c["name"] for c in cell_kl] == [report.RISING_CHECK] and cell_kl[0]["ok"] is None
  md = " ".join(report.markdown(rep).split())
  assert "| gen | low | 0.800 ± 0.040 | 9.0 |" in md
  assert "| gen/low | 1.5000 | 0.1026 | x14.6 |" in md
  assert "| gen/max | 0.5000 | -0.1000 | - |" in md
  # The grid's order of efforts and cells, whatever order the JSON files keep.
  assert ("(steps 0 → 19): KL(low ‖ high) 0.3000 → 0.1000, KL(high ‖ max) 0.2000 → "
          "0.2000.") in md
  assert "| gen/max | 0.7500 → 0.7500 | - |" in md
  assert "per sequence 2.0000 → 2.0000, token mean 1.0000 → 1.0000; the cells' norms sum to " \
      "1.50 → 1.50 and 1.00 → 1.00 times it" in md
  assert "| gen/max | 0.750 → 0.750 | 0.500 → 0.500 | 0.500 → 0.500 | 0.750 → 0.750 |" in md


def test_report_names_teachers_no_different_from_pi_sft():
  """A cell whose teacher writes pi_SFT's style at pi_SFT's accuracy (within two standard
  errors of the difference) is named, not hidden; a teacher of another length, or one clearly
  more accurate, is not."""
  from mopd_jax.evaluation import report
  grid = {"domains": ["gen"], "efforts": [["low", 0.3], ["high", 0.7], ["max", 1.5]]}
  cell = lambda p, e, acc, length: {"policy": p, "domain": "gen", "effort": e,
                                    "accuracy": acc, "mean_length": length, "n": 300}
  rep = {"grid": grid, "cells": [
      cell("sft", "low", 0.0, 6.0), cell("teacher", "low", 0.30, 3.0),  # another style
      cell("sft", "high", 0.73, 15.0), cell("teacher", "high", 0.70, 15.0),  # the same
      cell("sft", "max", 0.73, 15.0), cell("teacher", "max", 0.85, 15.2)],  # 12 points up
      "kl": {"curve": []}, "wall_seconds": {}}
  assert report.teachers_like_sft(rep) == ["gen/high"]
  assert "Teachers no different from pi_SFT in their own cell (the same mean length within " \
      "half a token, accuracies within two standard errors): `gen/high`." in " ".join(
          report.markdown(rep).split())


@pytest.mark.parametrize("student, teacher, n, ok", [
    (0.93, 1.00, 300, True),    # >= 0.9 x
    (0.85, 1.00, 300, False),   # 0.15 below a sure teacher: 7 standard errors
    (0.033, 0.047, 300, True),  # a guess: 0.70 x, 0.8 standard errors below
    (0.153, 0.190, 300, True),  # 0.81 x, 1.2 standard errors below
    (0.10, 0.19, 300, False),   # 3.1 standard errors below
    (0.10, 0.19, 0, False),     # no example counts: the ratio alone decides
])
def test_student_accuracy_result_allows_sampling_noise(student, teacher, n, ok):
  """The student's accuracy result: >= 0.9 x its teacher's, or within two standard errors
  of the difference (a near-chance cell on 300 examples cannot resolve 10%)."""
  from mopd_jax.evaluation import report
  grid = {"domains": ["gen"], "efforts": {"max": 1.0}}
  cells = [{"policy": p, "domain": "gen", "effort": "max", "accuracy": a, "mean_length": 9.0,
            "over_budget_rate": 0.0, **({"n": n} if n else {})}
           for p, a in (("student", student), ("teacher", teacher), ("sft", 0.5))]
  rep = {"grid": grid, "cells": cells, "kl": {}, "wall_seconds": {}}
  got = {c["name"]: c["ok"] for c in report.checks(rep)}
  assert got["student gen/max accuracy / teacher's"] is ok
