"""Several seeds' reports of one config as one summary (sweep.json, sweep.md): each cell's
accuracy and length as mean and standard deviation over the seeds, each seed's KL curve, and
which seeds meet each expected result of report.md."""
from __future__ import annotations

import json

import numpy as np

from mopd_jax.evaluation import agreement, kl_curves, report
from mopd_jax.tasks.grid import Grid


def sweep(reports: dict) -> dict:
  """Several seeds' report.json dicts ({seed: report}, one grid) as one summary: every
  cell's accuracy and mean length as mean and standard deviation over the seeds (population
  std, ddof 0), each seed's KL curve, and per expected result the seeds that meet it."""
  if not reports:
    raise ValueError("no seed has a report yet")
  seeds = sorted(reports)
  grids = {json.dumps(reports[s]["grid"], sort_keys=True) for s in seeds}
  if len(grids) != 1:
    raise ValueError(f"the seeds' reports are of different grids: {sorted(grids)}")
  grid = reports[seeds[0]]["grid"]
  cells = []
  for d, e in Grid.from_json(grid).cells:
    for p in report.POLICIES:
      got = [report.find_cell(reports[s]["cells"], p, d, effort=e) for s in seeds]
      got = [c for c in got if c is not None]
      if not got:
        continue
      row = {"policy": p, "domain": d, "effort": e, "seeds": len(got)}
      for key in ("accuracy", "mean_length", "over_budget_rate"):
        vals = np.asarray([c[key] for c in got], np.float64)
        row[key] = {"mean": float(vals.mean()), "std": float(vals.std()),
                    "values": vals.tolist()}
      cells.append(row)
  checks = {}
  for s in seeds:
    for c in reports[s].get("checks", []):
      entry = checks.setdefault(c["name"], {"target": c["target"], "met": [], "missed": [],
                                            "undecided": []})
      entry["met" if c["ok"] is True else "missed" if c["ok"] is False else "undecided"].append(s)
  per_seed = {}
  for s in seeds:
    rows = [c for c in reports[s].get("checks", []) if not report.is_wall_time(c["name"])]
    per_seed[str(s)] = {"met": sum(c["ok"] is True for c in rows), "of": len(rows),
                        "missed": [c["name"] for c in rows if c["ok"] is False],
                        "wall_seconds": reports[s].get("wall_seconds", {})}
  return {"seeds": seeds, "grid": grid, "cells": cells, "checks": checks,
          "per_seed": per_seed,
          "kl_curves": {str(s): reports[s]["kl"]["curve"] for s in seeds},
          "kl_exact_curves": {str(s): reports[s].get("kl_exact_curve") or [] for s in seeds},
          "kl_drop": {str(s): dict(zip(("ratio", "source"), kl_curves.kl_drop(reports[s])))
                      for s in seeds},
          # pi_SFT's over the student's exact KL on held-out prompts (eval.kl_rollouts).
          "kl_heldout_drop": {str(s): dict(zip(("ratio", "se"), held)) for s in seeds
                              if (held := agreement.heldout_drop(
                                  reports[s].get("kl_heldout") or {})) is not None},
          # The held-out KL of each policy, and the init's and the on-policy steps' drops.
          "kl_heldout": {str(s): _heldout_summary(reports[s].get("kl_heldout") or {})
                         for s in seeds if reports[s].get("kl_heldout")}}


def _heldout_summary(held: dict) -> dict:
  """{policy: [KL, SE]} and the init's and the on-policy drops ([ratio, SE] or None)."""
  out = {p: [held[p]["kl_exact"], held[p]["kl_exact_se"]] for p in ("sft", "init", "student")
         if p in held}
  init = agreement.heldout_drop(held, "sft", "init")
  steps = agreement.heldout_drop(held, agreement.on_policy_start(held), "student")
  out["init_drop"] = None if init is None else list(init)
  out["on_policy_drop"] = None if steps is None else list(steps)
  return out


def sweep_markdown(sw: dict) -> str:
  seeds = sw["seeds"]
  lines = [f"# mopd_jax seed sweep: seeds {', '.join(map(str, seeds))}", "",
           "Accuracy and mean length on the test split, mean ± standard deviation over the "
           "seeds (ddof 0).", "",
           "| domain | effort | "
           + " | ".join(f"{p} acc | {p} len" for p in report.POLICIES) + " |",
           "|---|---|" + "---|---|" * len(report.POLICIES)]
  by = {(c["policy"], c["domain"], c["effort"]): c for c in sw["cells"]}
  for d, e in Grid.from_json(sw["grid"]).cells:
    row = [d, e]
    for p in report.POLICIES:
      c = by.get((p, d, e))
      row += (["-", "-"] if c is None else
              [f"{c['accuracy']['mean']:.3f} ± {c['accuracy']['std']:.3f}",
               f"{c['mean_length']['mean']:.1f} ± {c['mean_length']['std']:.1f}"])
    lines.append("| " + " | ".join(row) + " |")
  if sw["checks"]:
    every = sum(1 for c in sw["checks"].values() if len(c["met"]) == len(seeds))
    lines += ["", f"Expected results met on every seed: {every} of {len(sw['checks'])}.", "",
              "| check | target | seeds meeting it | seeds missing it |", "|---|---|---|---|"]
    lines += [f"| {name} | {c['target']} | {', '.join(map(str, c['met'])) or '-'} | "
              f"{', '.join(map(str, c['missed'])) or '-'} |"
              for name, c in sw["checks"].items()]
  per_seed = sw.get("per_seed", {})
  if per_seed:
    stages = list(dict.fromkeys(k for p in per_seed.values() for k in p["wall_seconds"]))
    lines += ["", "Per seed: expected results met without the wall-time rows, the ones "
              "missed, and each stage's wall seconds.", "",
              "| seed | met | missed | " + " | ".join(stages) + " |",
              "|---|---|---|" + "---|" * len(stages)]
    for s, p in per_seed.items():
      secs = [f"{p['wall_seconds'][k]:.0f}" if k in p["wall_seconds"] else "-" for k in stages]
      lines.append(f"| {s} | {p['met']} of {p['of']} | {'; '.join(p['missed']) or '-'} | "
                   + " | ".join(secs) + " |")
  drops = sw.get("kl_drop", {})
  if any(d["ratio"] is not None for d in drops.values()):
    lines += ["", "KL drop per seed (exact KL on the MOPD batches: pi_SFT's before the init over "
              "the last tenth of the MOPD steps'): " + ", ".join(
        f"seed {s} " + ("-" if d["ratio"] is None else f"x{d['ratio']:.1f} ({d['source']})")
        for s, d in drops.items()) + "."]
  summary = sw.get("kl_heldout", {})
  if summary:
    fmt = lambda v: "-" if v is None else f"{v[0]:.4f} ± {v[1]:.4f}"
    ratio = lambda v: "-" if v is None else f"x{v[0]:.2f} ± {v[1]:.2f}"
    lines += ["", "Held-out exact KL to the routed teachers (each policy's own rollouts of test "
              "prompts, ± standard error), the init's drop (pi_SFT / initialised student) and "
              "the on-policy drop (initialised, or pi_SFT without an init, / final student):",
              "", "| seed | pi_SFT | initialised | final | init's drop | on-policy drop |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {fmt(h.get('sft'))} | {fmt(h.get('init'))} | {fmt(h.get('student'))} "
              f"| {ratio(h['init_drop'])} | {ratio(h['on_policy_drop'])} |"
              for s, h in summary.items()]
  held = sw.get("kl_heldout_drop", {})
  if held:
    lines += ["", "Held-out KL drop per seed (pi_SFT's over the student's exact KL on their own "
              "rollouts of test prompts, ± standard error; informational): " + ", ".join(
                  f"seed {s} x{d['ratio']:.1f} ± {d['se']:.1f}" for s, d in held.items()) + "."]
  return "\n".join(lines) + "\n"
