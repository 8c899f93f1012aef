"""What each part of the distillation buys: the MOPD, eval and report stages rerun with one
setting changed, on each seed's own data, pi_SFT and teachers.

    python -m experiments.ablate --config configs/toy.py --seeds 0,1,2 --workdir DIR \
        [--base SWEEP_DIR] [--rows init_only,eq15,...]

Each seed's base run is `SWEEP_DIR/seed_<s>` (a finished run of the default config, e.g.
`experiments.sweep`'s) or, without `--base`, `DIR/seed_<s>`, run here first. Every row runs
in `DIR/seed_<s>/<row>` on a copy of the base's data, pi_SFT and teachers (and, for the
rows that start from it, the base's teacher-SFT init, which they would recompute bitwise),
then `DIR/ablation.json` and `DIR/ablation.md` gather, per row, the mean ± standard
deviation over the seeds of the final student's held-out exact KL to its routed teachers
(`eval.kl_rollouts`), its drop from the MOPD steps' start, the student's expected results
met (accuracy and length per cell, lengths ordered by effort), the MOPD and eval stages'
wall seconds, the updates and the sampled tokens. `--summarize-only` writes the tables from
the rows that finished.

The rows (`ROWS`), each testing one claim:
- default: teacher-SFT init + 60 on-policy steps of the `vocab_kl` loss (the base run);
- init_only: the init alone (one step at lr 1e-12): what the on-policy steps add;
- eq15: K3 eq. 15's sampled-token log-ratio in the steps: the loss form;
- topk: the routed teacher's top-8 (truncated reverse KL): the loss form;
- sft_compute: SFT on the teachers' rollouts given the default's whole compute (the init's
  updates plus the MOPD steps', and the init's teacher rollouts plus as many as the steps
  sample, read from the config: `sft_compute_overrides`): on-policy against off-policy at
  equal compute (GKD's claim);
- rl_compute: RL on the student with the tasks' verifiable rewards (`mopd.loss=outcome`)
  in the 60 steps from the same init: distillation against RL at equal compute;
- future_kl: the `vocab_kl` loss with its future-KL term (`mopd.loss_args.vocab_kl.future_kl=1`),
  the rest of the sequence-level KL's gradient: whether charging a token with the KL of what
  follows it removes the rare rollouts that leave the teacher's track;
- clip: the `vocab_kl` gradient with eq. 15's reward clip (`mopd.loss_args.vocab_kl.clip`):
  whether bounding the pull of the 20-nat off-track positions lowers the KL;
- token_mean: the `vocab_kl` loss as a mean over every token (`mopd.loss_args.vocab_kl.per`)
  rather than eq. 15's 1/|y| per rollout: the weighting the held-out KL itself uses;
- from_sft: `configs/toy.py:from_sft`, on-policy steps only, from pi_SFT;
- from_sft_unclipped: the same without eq. 15's reward clip in `vocab_kl`'s expectation:
  what the clip does from pi_SFT;
- from_sft_eq15: the same with K3 eq. 15's sampled-token loss: what the loss does from pi_SFT.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np

# name: (config variant, overrides, starts from the base's teacher-SFT init)
ROWS = {
    "default": ("", [], True),
    "init_only": ("", ["--config.mopd.steps=1", "--config.mopd.lr=1e-12"], True),
    "eq15": ("", ["--config.mopd.loss=mopd"], True),
    "topk": ("", ["--config.mopd.loss=topk", "--config.mopd.loss_args.topk.k=8"], True),
    # the init's and the steps' updates and samples: sft_compute_overrides
    "sft_compute": ("", ["--config.mopd.steps=1", "--config.mopd.lr=1e-12"], False),
    "rl_compute": ("", ["--config.mopd.loss=outcome", "--config.mopd.alpha=1.0"], True),
    "future_kl": ("", ["--config.mopd.loss_args.vocab_kl.future_kl=1.0"], True),
    "clip": ("", ["--config.mopd.loss_args.vocab_kl.clip=True"], True),
    "token_mean": ("", ["--config.mopd.loss_args.vocab_kl.per=token"], True),
    "from_sft": (":from_sft", [], False),
    "from_sft_unclipped": (":from_sft", ["--config.mopd.loss_args.vocab_kl.clip=False"], False),
    "from_sft_eq15": (":from_sft", ["--config.mopd.loss=mopd",
                                    "--config.mopd.loss_args.vocab_kl.clip=False"], False),
}


def parse(argv):
  ap = argparse.ArgumentParser(prog="python -m experiments.ablate",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--config", required=True, help="the default config, e.g. configs/toy.py")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--base", default="", help="a sweep's directory holding seed_<s> runs")
  ap.add_argument("--rows", default=",".join(ROWS))
  ap.add_argument("--summarize-only", action="store_true")
  args = ap.parse_args(argv)
  try:
    args.seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
  args.rows = [r for r in args.rows.split(",") if r]
  unknown = [r for r in args.rows if r not in ROWS]
  if unknown:
    ap.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
  return args


def sft_compute_overrides(config: str) -> list:
  """The sft_compute row's init: as many SFT updates as the default's init and MOPD steps
  together, on as many teacher rollouts per cell as the init's plus those the steps sample
  (`prompts_per_cell` a step)."""
  path, _, variant = config.partition(":")
  spec = importlib.util.spec_from_file_location("ablate_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  m = mod.get_config(variant or None).mopd
  return [f"--config.mopd.init_sft_steps={m.init_sft_steps + m.steps}",
          f"--config.mopd.init_samples_per_cell="
          f"{m.init_samples_per_cell + m.steps * m.prompts_per_cell}"]


def _run(*extra) -> int:
  return subprocess.call([sys.executable, "-m", "experiments.run", *extra])


def base_dir(args, seed: int) -> str:
  if args.base:
    return os.path.join(args.base, f"seed_{seed}")
  return os.path.join(args.workdir, f"seed_{seed}")


def run_row(args, seed: int, row: str) -> str:
  """The row's workdir, after running it unless it has a report."""
  base = base_dir(args, seed)
  if row == "default":
    if not os.path.exists(os.path.join(base, "report.json")):
      rc = _run("--config", args.config, "--workdir", base, f"--config.seed={seed}")
      if rc:
        raise SystemExit(rc)
    return base
  wd = os.path.join(args.workdir, f"seed_{seed}", row)
  if os.path.exists(os.path.join(wd, "report.json")):
    return wd
  variant, overrides, same_init = ROWS[row]
  if row == "sft_compute":
    overrides = overrides + sft_compute_overrides(args.config)
  os.makedirs(wd, exist_ok=True)
  for part in ("data", "sft", "rl", "teachers.json"):
    src, dst = os.path.join(base, part), os.path.join(wd, part)
    if not os.path.exists(dst):
      (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
  if same_init and not os.path.exists(os.path.join(wd, "mopd")):
    os.makedirs(os.path.join(wd, "mopd"))
    shutil.copytree(os.path.join(base, "mopd", "init_ckpt"), os.path.join(wd, "mopd",
                                                                          "init_ckpt"))
    shutil.copy(os.path.join(base, "mopd", "start.json"), os.path.join(wd, "mopd"))
  rc = _run("--config", args.config + variant, "--workdir", wd, f"--config.seed={seed}",
            "--config.stages=mopd,eval,report", *overrides)
  if rc:
    raise SystemExit(rc)
  return wd


def measure(wd: str) -> dict:
  """A row's figures from its report.json and mopd history."""
  from mopd_jax.evaluation import agreement  # pylint: disable=g-import-not-at-top
  from mopd_jax.tasks.grid import Grid  # pylint: disable=g-import-not-at-top
  rep = json.load(open(os.path.join(wd, "report.json")))
  held = rep.get("kl_heldout") or {}
  student = [c for c in rep["checks"] if c["name"].startswith("student ")]
  hist = json.load(open(os.path.join(wd, "mopd", "history.json")))
  done = json.load(open(os.path.join(wd, "mopd", "DONE.json")))
  cfg = rep["config"]["mopd"]
  init_updates = cfg["init_sft_steps"] if cfg["init"] == "teacher_sft" else 0
  steps = cfg["steps"] if cfg["lr"] > 1e-9 else 0  # a step at lr 1e-12 trains nothing
  drop = (agreement.heldout_drop(held, agreement.on_policy_start(held), "student") if steps
          else None)  # no on-policy step: nothing to divide
  return {
      "kl": held.get("student", {}).get("kl_exact"),
      "kl_se": held.get("student", {}).get("kl_exact_se"),
      "on_policy_drop": None if drop is None else drop[0],
      "student_met": sum(c["ok"] is True for c in student), "student_of": len(student),
      "seconds": rep["wall_seconds"].get("mopd", 0.0) + rep["wall_seconds"].get("eval", 0.0),
      "mopd_seconds": done.get("seconds"),
      "updates": init_updates + steps,
      "student_tokens": float(sum(h["length"] * h["num_rows"] for h in hist)) if steps else 0.0,
      "teacher_rollouts": (cfg["init_samples_per_cell"] * len(Grid.from_json(rep["grid"]).cells)
                           if init_updates else 0)}


def summarize(args) -> dict:
  rows = {}
  for row in args.rows:
    per_seed = {}
    for s in args.seeds:
      wd = base_dir(args, s) if row == "default" else os.path.join(args.workdir, f"seed_{s}",
                                                                    row)
      if os.path.exists(os.path.join(wd, "report.json")):
        per_seed[str(s)] = measure(wd)
    rows[row] = per_seed
  out = {"seeds": args.seeds, "rows": rows}
  with open(os.path.join(args.workdir, "ablation.json"), "w") as f:
    json.dump(out, f, indent=1)
  with open(os.path.join(args.workdir, "ablation.md"), "w") as f:
    f.write(markdown(out))
  return out


def _ms(vals, fmt="{:.4f}") -> str:
  vals = [v for v in vals if v is not None]
  if not vals:
    return "-"
  return (fmt.format(np.mean(vals)) + " ± " + fmt.format(np.std(vals))) + (
      f" (n={len(vals)})" if len(vals) > 1 else " (n=1)")


def markdown(out: dict) -> str:
  lines = ["# mopd_jax ablation: seeds " + ", ".join(map(str, out["seeds"])), "",
           "Mean ± standard deviation over the seeds (ddof 0) that ran the row. Held-out KL: the "
           "final student's exact per-token KL to its routed teachers on its own rollouts of "
           "the test prompts (eval.kl_rollouts per domain at every effort); on-policy drop: "
           "the MOPD steps' start (the initialised student, or pi_SFT) over the final student; "
           "student results: the accuracy, length and length-order rows of report.md; seconds: "
           "the MOPD and eval stages' wall time; updates: the init's and the MOPD steps'; "
           "tokens: those the student sampled in the MOPD steps (teacher rollouts: sampled by "
           "the init).", "",
           "| row | held-out KL | per-seed KL ± s.e. | on-policy drop | student results met | "
           "seconds | updates | student tokens | teacher rollouts |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row, per in out["rows"].items():
    if not per:
      continue
    vals = list(per.values())
    seeds = "; ".join(f"s{s}: {v['kl']:.4f} ± {v['kl_se']:.4f}" for s, v in per.items()
                      if v["kl"] is not None)
    met = "; ".join(f"s{s}: {v['student_met']}/{v['student_of']}" for s, v in per.items())
    lines.append(
        f"| {row} | {_ms([v['kl'] for v in vals])} | {seeds} | "
        f"{_ms([v['on_policy_drop'] for v in vals], '{:.2f}')} | {met} | "
        f"{_ms([v['seconds'] for v in vals], '{:.0f}')} | "
        f"{int(np.mean([v['updates'] for v in vals]))} | "
        f"{_ms([v['student_tokens'] for v in vals], '{:.0f}')} | "
        f"{int(np.mean([v['teacher_rollouts'] for v in vals]))} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = parse(sys.argv[1:] if argv is None else argv)
  os.makedirs(args.workdir, exist_ok=True)
  if not args.summarize_only:
    for s in args.seeds:
      for row in args.rows:
        run_row(args, s, row)
        summarize(args)
  print(markdown(summarize(args)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
