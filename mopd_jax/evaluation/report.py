"""The run report: report.json (machine-readable), report.md and PNG plots, for any task grid
(the run's domains x efforts, recorded in report.json as `grid`)."""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from mopd_jax.evaluation import agreement, kl_curves, report_plots
from mopd_jax.io import checkpoint, profiling, storage
from mopd_jax.tasks.grid import Grid
from mopd_jax.teachers import parity
from mopd_jax.training import diagnostics

POLICIES = ("sft", "teacher", "student")


def build(workdir: str, config_json: dict, wall_seconds: dict, *, grid: Grid) -> dict:
  ev = checkpoint.read_json(storage.join(workdir, "eval.json"))
  hist_path = storage.join(workdir, "mopd", "history.json")
  history = checkpoint.read_json(hist_path) if storage.exists(hist_path) else []
  curve = [[h["step"], h["kl"]] for h in history]
  data_done = storage.join(workdir, "data", "DONE.json")
  records = (checkpoint.read_json(data_done).get("records", {})
             if storage.exists(data_done) else {})
  for d in records:  # b0 measured from samples of pi_SFT (budget.source=samples)
    measured = storage.join(workdir, "budgets", f"{d}.json")
    if storage.exists(measured):
      records[d]["b0_samples"] = checkpoint.read_json(measured)["counts"]
  exact_per_cell = {name: [[h["step"], h["cells"][name]["kl_exact"]] for h in history
                           if "kl_exact" in h["cells"].get(name, {})]
                    for name in (history[0]["cells"] if history else {})}
  return {
      "grid": grid.to_json(),
      # Per record domain: kept / dropped / skipped counts and the b0 distribution per split.
      "data": records,
      # eval.json's cells, each with the binomial standard error of its accuracy.
      "cells": [dict(c, accuracy_se=binomial_se(c["accuracy"], c["n"])) if "n" in c else c
                for c in ev["cells"]],
      "kl": {"initial": curve[0][1] if curve else None,
             "final": curve[-1][1] if curve else None, "curve": curve,
             **initial_kl_by_cell(workdir, history)},
      # The exact full-vocabulary KL, on the steps that measured it (mopd.exact_kl_every).
      "kl_exact_curve": [[h["step"], h["kl_exact"]] for h in history if "kl_exact" in h],
      # pi_SFT's and the student's exact KL on held-out prompts (eval.kl_rollouts), if any.
      "kl_heldout": ev.get("kl_heldout"),
      # pi_SFT's exact KL before the teacher-SFT initialisation (mopd/start.json), if any.
      "kl_start": (checkpoint.read_json(start) if storage.exists(
          start := storage.join(workdir, "mopd", "start.json")) else None),
      "kl_exact_per_cell": exact_per_cell,
      # Each cell's exact KL, first over last tenth of its measured steps (informational).
      "kl_exact_drop_per_cell": kl_curves.kl_drop_per_cell(exact_per_cell),
      # Effort sensitivity and loss shares on the steps that measured them (diagnostics.py).
      **diagnostics.report_entries(history),
      "reward_curve": [[h["step"], h["reward_mean"]] for h in history],
      # Fraction of generated tokens whose reward r_t is clipped at +-r_max, per step.
      "clip_frac_curve": [[h["step"], h["clip_frac"]] for h in history if "clip_frac" in h],
      "kl_per_cell": {name: [[h["step"], h["cells"][name]["kl"]] for h in history
                             if name in h["cells"]]
                      for name in (history[0]["cells"] if history else {})},
      **parity.report_entries(checkpoint.read_json(parity_path) if storage.exists(
          parity_path := storage.join(workdir, "teacher_parity.json")) else None, history),
      "wall_seconds": wall_seconds,
      "config": config_json,
  }


def checks(rep: dict) -> list:
  """The toy run's expected results, evaluated on this run: a list of {name, value, target,
  ok}; `ok` is None where the run lacks what a check needs (e.g. a `--config.stages`
  subset), and for a teacher's gain over pi_SFT where the teacher is of another tokenizer
  (its RL started from its own factory's pi_SFT). pi_SFT's accuracy on a domain is taken in
  its largest-tau cell, the one budget where no style is cut, so a teacher is compared with
  pi_SFT at equal room. Lengths are expected to grow with tau."""
  cells, out = rep["cells"], []
  grid = Grid.from_json(rep["grid"])
  top, by_budget = grid.top_effort, grid.by_budget

  def add(name, value, target, *, ok):
    out.append({"name": name, "value": value, "target": target,
                "ok": None if ok is None else bool(ok)})

  def get(policy, d, e, *, key):
    c = find_cell(cells, policy, d, effort=e)
    return None if c is None else c[key]

  origins = {n: c["origin"] for n, c in rep.get("kl", {}).get("initial_by_cell", {}).items()}
  for d in grid.domains:
    t, f = get("teacher", d, top, key="accuracy"), get("sft", d, top, key="accuracy")
    gain = None if t is None or f is None else t - f
    name = f"teacher {d}/{top} accuracy - pi_SFT {d}/{top} accuracy"
    if origins.get(f"{d}/{top}") == OTHER_TOKENIZER:  # its RL started from its own pi_SFT
      add(name, gain, OTHER_PARENT, ok=None)
      continue
    add(name, gain, ">= 0.10", ok=None if gain is None else gain >= 0.10 - 1e-9)
  if len(by_budget) > 1:
    for policy in ("teacher", "student"):
      for d in grid.domains:
        lens = [get(policy, d, e, key="mean_length") for e in by_budget]  # smallest tau first
        ok = None if None in lens else all(b > a for a, b in zip(lens, lens[1:]))
        add(f"{policy} {d} mean length {' < '.join(by_budget)}", lens, "strict", ok=ok)
  for d in grid.domains:
    for e in grid.effort_names:
      over = get("teacher", d, e, key="over_budget_rate")
      add(f"teacher {d}/{e} over-budget rate", over, "<= 0.05",
          ok=None if over is None else over <= 0.05)
  for d in grid.domains:
    for e in grid.effort_names:
      sc, tc = find_cell(cells, "student", d, effort=e), find_cell(cells, "teacher", d, effort=e)
      sa, ta = (None if c is None else c["accuracy"] for c in (sc, tc))
      ok = None
      if sa is not None and ta is not None:
        se = accuracy_diff_se(sc, tc)
        ok = sa >= 0.9 * ta - 1e-9 or (se is not None and ta - sa <= 2 * se + 1e-9)
      add(f"student {d}/{e} accuracy / teacher's", None if sa is None else [sa, ta],
          ">= 0.9 x, or within 2 SE", ok=ok)
      sl, tl = get("student", d, e, key="mean_length"), get("teacher", d, e, key="mean_length")
      add(f"student {d}/{e} mean length / teacher's", None if sl is None else [sl, tl],
          "within +-25%", ok=None if sl is None or tl is None else abs(sl - tl) <= 0.25 * tl)
  for name, c in rep["kl"].get("outside_vs_same", {}).items():
    gap = abs(c["outside_accuracy"] - c["same_accuracy"])
    add(f"outside teacher {name} validation accuracy - same-origin teacher's", gap,
        "<= 0.10", ok=gap <= 0.10 + 1e-9)
  drop, source = kl_curves.kl_drop(rep)
  exact = source != "sampled"  # else shown under its own name, not held to the exact KL's bar
  add(KL_DROP_CHECK if exact else KL_DROP_SAMPLED_ROW, drop, ">= 5" if exact else "-",
      ok=None if drop is None or not exact else drop >= 5)
  held = {p: h for p, h in (rep.get("kl_heldout") or {}).items()
          if h.get("measure", "exact") == "exact"}  # the rows below read the exact KL only
  init = agreement.heldout_drop(held, "sft", "init")
  add(INIT_DROP_CHECK, None if init is None else list(init), ">= 5",
      ok=None if init is None else init[0] >= 5)
  start = agreement.on_policy_start(held)
  steps = None if start is None else agreement.heldout_drop(held, start, "student")
  add(ON_POLICY_DROP_CHECK, None if steps is None else list(steps), ">= 2",
      ok=None if steps is None else steps[0] >= 2)
  rising = (None if start is None or "student" not in held else
            agreement.rising_cells(held, start, "student"))
  add(RISING_CHECK, rising, "none", ok=None if rising is None else not rising)
  w = rep["wall_seconds"]
  factory = w["sft"] + w["rl"] if "sft" in w and "rl" in w else None
  add("teacher factory wall seconds (sft + rl)", factory, "<= 720",
      ok=None if factory is None else factory <= 720)
  total = w.get("total")
  add("pipeline wall seconds", total, "<= 600", ok=None if total is None else total <= 600)
  return out


KL_DROP_CHECK = ("exact per-token KL on the MOPD batches, pi_SFT's before the init / the "
                 "last tenth of the MOPD steps'")
# Without the exact KL (`mopd.exact_kl_every=0`, teachers served or of another tokenizer) the
# MOPD steps' sampled log-ratio: its first tenth is after any init, so the drop says what the
# steps did, and one rollout off its teacher's style moves a step's value 10x: shown only.
KL_DROP_SAMPLED_ROW = ("sampled per-token log-ratio on the MOPD batches, the first / the "
                       "last tenth of the MOPD steps' (shown, not judged)")
# The held-out measures (`eval.kl_rollouts`): each policy's exact KL to its routed teachers
# on its own rollouts of test prompts (`agreement.heldout_kl`), value [ratio, its SE].
INIT_DROP_CHECK = ("held-out exact KL, pi_SFT / the initialised student (the init's drop; "
                   "value: ratio / its standard error)")
ON_POLICY_DROP_CHECK = ("held-out exact KL, the MOPD steps' start / the final student (the "
                        "on-policy drop; start: the initialised student, pi_SFT without init; "
                        "value: ratio / its standard error)")
RISING_CHECK = ("cells whose held-out exact KL rises from the MOPD steps' start to the final "
                "student by more than 2 standard errors")
WALL_TIME_CHECKS = ("teacher factory wall seconds (sft + rl)", "pipeline wall seconds")


def is_wall_time(name: str) -> bool:
  """Whether an expected result is a wall-time bar (machine-dependent, so sweeps count the
  method's results without them)."""
  return name in WALL_TIME_CHECKS


def binomial_se(p: float, n: int) -> Optional[float]:
  """sqrt(p (1 - p) / n): the standard error of an accuracy p measured on n examples;
  None without examples."""
  return float(np.sqrt(p * (1.0 - p) / n)) if n else None


def accuracy_diff_se(a: dict, b: dict) -> Optional[float]:
  """The standard error of the difference of two cells' accuracies, each measured on its
  own `n` examples; None when either lacks them. A near-chance cell (a low effort's guess at
  0.04) cannot resolve a 10% relative gap on 300 examples: two equally good guessers differ
  by more than that about 40% of the time, so the student's accuracy result also accepts a
  gap within two of these."""
  if not a.get("n") or not b.get("n"):
    return None
  return float(np.hypot(binomial_se(a["accuracy"], a["n"]), binomial_se(b["accuracy"], b["n"])))


def teachers_like_sft(rep: dict) -> list:
  """The cells whose teacher does not differ from pi_SFT there: the same mean length within
  half a token (the same style) and accuracies within two standard errors of their
  difference. Such a teacher adds nothing RL learned to its cell, so the student has no
  effort-specific behaviour to take from it there."""
  out = []
  for d, e in Grid.from_json(rep["grid"]).cells:
    t = find_cell(rep["cells"], "teacher", d, effort=e)
    f = find_cell(rep["cells"], "sft", d, effort=e)
    if t is None or f is None or not t.get("n") or not f.get("n"):
      continue
    se = accuracy_diff_se(t, f)
    if (abs(t["mean_length"] - f["mean_length"]) <= 0.5 and
        abs(t["accuracy"] - f["accuracy"]) <= 2 * se + 1e-9):
      out.append(f"{d}/{e}")
  return out


OTHER_TOKENIZER = "other tokenizer"
# A teacher of another tokenizer was made by RL from its own factory's pi_SFT, not from this
# run's: its gain over this run's pi_SFT is shown, and its factory's report judges its RL.
OTHER_PARENT = "- (its parent is its own factory's pi_SFT: judged in that run's report)"


def teacher_origin(entry: dict) -> str:
  """A manifest entry's origin: "other tokenizer" for a teacher of another tokenizer
  (`teacher.tokenizer_path`), else its recorded origin ("same" when none)."""
  if (entry.get("tokenizer") or {}).get("other"):
    return OTHER_TOKENIZER
  return entry.get("origin", "same")


def initial_kl_by_cell(workdir: str, history: list) -> dict:
  """Per-token KL student vs routed teacher at the first MOPD step, per cell, with the
  teacher's origin ("same": trained from the student's own pi_SFT; "outside": from another
  SFT, see `teacher.outside_cell`; "other tokenizer": its KL the per-span log-ratio spread
  over the student's tokens), and its mean over the cells of each origin."""
  if not history:
    return {"initial_by_cell": {}, "initial_by_origin": {}}
  path = storage.join(workdir, "teachers.json")
  routed = checkpoint.read_json(path)["teachers"] if storage.exists(path) else {}
  by_cell = {name: {"kl": cm["kl"], "origin": teacher_origin(routed.get(name, {}))}
             for name, cm in history[0]["cells"].items()}
  by_origin = {}
  for c in by_cell.values():
    by_origin.setdefault(c["origin"], []).append(c["kl"])
  return {"initial_by_cell": by_cell,
          "initial_by_origin": {o: float(np.mean(v)) for o, v in by_origin.items()},
          "outside_vs_same": outside_vs_same(
              checkpoint.read_json(path) if storage.exists(path) else {})}


def outside_vs_same(manifest: dict) -> dict:
  """Per outside cell: the validation accuracy of the outside teacher and of the same-origin
  teacher it replaces (both measured by the rl stage on the same prompts), so the ablation
  compares origins at similar quality."""
  out = {}
  for name, same in manifest.get("same_origin", {}).items():
    t = manifest["teachers"].get(name, {})
    if t.get("origin") == "outside" and t.get("eval_validation") and same.get("eval_validation"):
      out[name] = {"outside_accuracy": t["eval_validation"]["accuracy"],
                   "same_accuracy": same["eval_validation"]["accuracy"]}
  return out


def find_cell(cells, policy, domain, *, effort):
  """The report cell of (policy, domain, effort) in `cells`, or None."""
  for c in cells:
    if (c["policy"], c["domain"], c["effort"]) == (policy, domain, effort):
      return c
  return None


def markdown(rep: dict) -> str:
  cells = rep["cells"]
  lines = ["# mopd_jax run report", "",
           "Accuracy ± its binomial standard error sqrt(p(1-p)/n) (n: the cell's test "
           "examples) and mean length on the test split, per (domain, effort).",
           "", "| domain | effort | " + " | ".join(
               f"{p} acc | {p} len" for p in POLICIES) + " |",
           "|---|---|" + "---|---|" * len(POLICIES)]
  for d, e in Grid.from_json(rep["grid"]).cells:
    row = [d, e]
    for p in POLICIES:
      c = find_cell(cells, p, d, effort=e)
      se = None if c is None else binomial_se(c["accuracy"], c.get("n"))
      row += ["-", "-"] if c is None else [
          f"{c['accuracy']:.3f}" + ("" if se is None else f" ± {se:.3f}"),
          f"{c['mean_length']:.1f}"]
    lines.append("| " + " | ".join(row) + " |")
  lines += agreement.logratio_table(rep["cells"], Grid.from_json(rep["grid"]).cells)
  same = teachers_like_sft(rep)
  if same:
    lines += ["", "Teachers no different from pi_SFT in their own cell (the same mean length "
              "within half a token, accuracies within two standard errors): " +
              ", ".join(f"`{c}`" for c in same) + ". There RL kept pi_SFT's greedy answer, "
              "and the toy does not separate that effort from pi_SFT's behaviour."]
  kl = rep["kl"]
  if kl["curve"]:
    first, last, n, _ = kl_curves.kl_window_means(kl["curve"])
    single = (f"x{kl['initial'] / kl['final']:.1f}" if kl["final"] > 0 else
              "at or below 0 at the last step, so no ratio")
    lines += ["", f"Per-token KL student vs routed teacher, sampled-token estimate: first step "
              f"{kl['initial']:.4f}, last {kl['final']:.4f} ({single}); mean over the first / "
              f"last {n} steps {first:.4f} / {last:.4f}" + (
                  f" (x{first / last:.1f})." if last > 0 else ".")]
  exact = rep.get("kl_exact_curve") or []
  if exact:
    first, last, m1, m2 = kl_curves.kl_window_means(exact)
    tail = kl_curves.kl_windows(exact)[1]
    se = (f", the last tenth's standard error {np.std(tail, ddof=1) / np.sqrt(len(tail)):.4f}"
          if len(tail) > 1 else "")
    lines += ["", f"Exact per-token KL over the whole vocabulary (on the student's own "
              f"rollouts, {len(exact)} steps measured): first {exact[0][1]:.4f}, last "
              f"{exact[-1][1]:.4f}; mean over the first / last tenth of the steps ({m1} / "
              f"{m2} measured) {first:.4f} / {last:.4f}{se}" + (
                  f" (x{first / last:.1f})." if last > 0 else ".")]
  start = rep.get("kl_start")
  if start:
    lines += ["", f"Exact per-token KL of pi_SFT as trained, where the student starts (at "
              f"`mopd.start_temperature`) before its teacher-SFT initialisation, on its own "
              f"rollouts of the first step's prompts: {start['kl_exact']:.4f}."]
  ratio, source = kl_curves.kl_drop(rep)
  if ratio is not None:
    measure = ("the exact KL, pi_SFT's before the teacher-SFT init" if source.startswith(
        "exact,") else f"the {source} KL, the first tenth's")
    lines += ["", f"KL drop (the expected result's measure: {measure} over the last tenth of "
              f"the MOPD steps): x{ratio:.1f}."]
  lines += agreement.heldout_lines(rep.get("kl_heldout") or {})
  drops = rep.get("kl_exact_drop_per_cell") or {}
  if drops:
    lines += ["", "Exact per-token KL per cell, mean over the first / last tenth of the "
              "MOPD steps and their ratio (informational, not an expected result):", "",
              "| cell | first tenth | last tenth | drop |", "|---|---|---|---|"]
    lines += [f"| {name} | {d['first']:.4f} | {d['last']:.4f} | "
              f"{'-' if d['drop'] is None else 'x' + format(d['drop'], '.1f')} |"
              for name, d in ((n, drops[n]) for n in Grid.from_json(rep["grid"]).names
                              if n in drops)]
  lines += diagnostics.report_lines(rep)
  clip = [v for _, v in rep.get("clip_frac_curve") or []]
  if clip:
    lines += ["", f"Reward clipped at +-r_max on {100 * sum(clip) / len(clip):.2f}% of the "
              f"generated tokens (mean over the {len(clip)} MOPD steps; largest step "
              f"{100 * max(clip):.2f}%)."]
  lines += parity.report_lines(rep)
  if kl.get("initial_by_cell"):
    lines += ["", "Initial per-token KL (first MOPD step) per routed teacher; origin `same` = "
              "trained from the student's pi_SFT, `outside` = from another SFT "
              "initialisation, `other tokenizer` = a teacher of another tokenizer (its "
              "value the sampled log-ratio of aligned spans per student token); a "
              "sampled-token estimate, so one cell's value at a few "
              "prompts can be negative. Mean by origin: " + ", ".join(
                  f"{o} {v:.4f}" for o, v in sorted(kl["initial_by_origin"].items())) + ".",
              "The teacher's test accuracy sits beside it, so a comparison of origins can "
              "be read against the teachers' quality.",
              "", "| teacher | origin | initial KL | teacher accuracy |", "|---|---|---|---|"]
    for name, c in kl["initial_by_cell"].items():
      domain, effort = name.split("/")
      t = find_cell(rep["cells"], "teacher", domain, effort=effort)
      lines.append(f"| {name} | {c['origin']} | {c['kl']:.4f} | "
                   f"{'-' if t is None else format(t['accuracy'], '.3f')} |")
    for name, c in kl.get("outside_vs_same", {}).items():
      lines += ["", f"The outside `{name}` teacher answers {c['outside_accuracy']:.3f} of the "
                f"validation prompts, the same-origin teacher it replaces "
                f"{c['same_accuracy']:.3f} (rl stage, greedy)."]
  if rep.get("checks"):
    passed = sum(c["ok"] is True for c in rep["checks"])
    known = sum(c["ok"] is not None for c in rep["checks"])
    lines += ["", f"Expected results of the toy run: {passed} of {known} met (pi_SFT's domain "
              "accuracy is its largest-tau cell's).", "",
              "| check | value | target | met |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {_fmt(c['value'])} | {c['target']} | "
              f"{'-' if c['ok'] is None else 'yes' if c['ok'] else 'no'} |" for c in rep["checks"]]
  if rep.get("data"):
    lines += ["", "Base budgets b0 (tokens) of the record domains' training prompts, and what "
              "the data stage dropped:", "",
              "| domain | n | mean | min | p10 | p50 | p90 | max | duplicates | no b0 | "
              "over-long |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, c in rep["data"].items():
      b = c["b0"]["train"]
      splits = [s for s in ("train", "validation", "test") if s in c]
      no_b0 = sum(c[s]["no_budget"] for s in splits)
      if "b0_samples" in c:  # measured over every split; no correct sample = no b0
        b = dict(c["b0_samples"], n=c["b0_samples"]["measured"])
        no_b0 += c["b0_samples"]["no_correct_sample"]
      lines.append(
          f"| {d} | {b['n']} | {b['mean']:.1f} | " + " | ".join(
              f"{b[k]:.0f}" for k in ("min", "p10", "p50", "p90", "max")) +
          f" | {c['train_duplicates'] + c['test_duplicates']} | {no_b0} | "
          f"{sum(c[s]['too_long'] for s in splits)} |")
  compiling = profiling.compile_line(rep.get("compile_seconds") or {})
  lines += ["", "Wall seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                             rep["wall_seconds"].items()) + "."]
  lines += ["", compiling] if compiling else []
  lines += ["",
            "![cells](cells.png)", "", "![kl](kl.png)", "", "![length](length.png)"]
  return "\n".join(lines) + "\n"


def _fmt(v) -> str:
  if v is None:
    return "-"
  if isinstance(v, (list, tuple)):
    return " / ".join(_fmt(x) for x in v) if v else "none"
  return f"{v:.3f}" if isinstance(v, float) else str(v)


def write(workdir: str, config_json: dict, wall_seconds: dict, *, grid: Grid,
          compile_seconds: Optional[dict] = None) -> dict:
  """`compile_seconds`: {stage or "rl lane <domain>": {seconds, programs[, wall]}}, the
  time each process spent compiling (`profiling.CompileClock`), shown beside the wall
  seconds."""
  rep = build(workdir, config_json, wall_seconds, grid=grid)
  rep["compile_seconds"] = compile_seconds or {}
  rep["checks"] = checks(rep)
  rep["teachers_like_sft"] = teachers_like_sft(rep)  # cells RL did not move (informational)
  checkpoint.write_json(storage.join(workdir, "report.json"), rep)
  if jax.process_index() == 0:  # the workdir is shared: one writer
    storage.write_text(storage.join(workdir, "report.md"), markdown(rep))
    report_plots.plots(rep, workdir, policies=POLICIES)
  return rep
