"""Several seeds of one config: `python -m experiments.sweep --config configs/toy.py
--seeds 0,1,2 --workdir DIR [--config.field=value ...]`.

Runs `experiments.run` once per seed, each in its own workdir `DIR/seed_<s>` (so a sweep
resumes: a seed's finished stages are skipped, an interrupted one continues), one after
another, then writes `DIR/sweep.json` and `DIR/sweep.md` (mopd_jax.evaluation.sweep_report.sweep: every
cell's accuracy and length as mean and standard deviation over the seeds, each seed's KL
curve, and which seeds meet each expected result of report.md). `--summarize-only` writes the
summary of the seeds that have a report without running anything. Config overrides are
passed to every seed's run as they are (use the `--config.field=value` form); `seed` is set by
the sweep.

Errors: a bad argument prints one line and exits with status 2; a seed whose run fails stops
the sweep with that run's exit status, after summarising the seeds that finished.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from mopd_jax.evaluation import sweep_report
from mopd_jax.io import checkpoint, storage


def parse(argv) -> tuple:
  ap = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.split(
      "\n\n")[0])
  ap.add_argument("--config", required=True, help="a config file, e.g. configs/toy.py[:fast]")
  ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--summarize-only", action="store_true")
  args, rest = ap.parse_known_args(argv)
  bad = [a for a in rest if not (a.startswith("--config.") and "=" in a)]
  if bad:
    ap.error(f"unexpected arguments {bad}; config overrides take the form --config.field=value")
  if any(a.startswith("--config.seed=") for a in rest):
    ap.error("--config.seed is set by the sweep; use --seeds")
  try:
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  except ValueError:
    ap.error(f"--seeds must be comma-separated ints, got {args.seeds!r}")
  if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
    ap.error(f"--seeds must name distinct seeds >= 0, got {args.seeds!r}")
  return args, rest, seeds


def seed_dir(workdir: str, seed: int) -> str:
  return storage.join(workdir, f"seed_{seed}")


def summarize(workdir: str, seeds) -> dict:
  reports = {s: checkpoint.read_json(storage.join(seed_dir(workdir, s), "report.json"))
             for s in seeds if storage.exists(storage.join(seed_dir(workdir, s), "report.json"))}
  sw = sweep_report.sweep(reports)
  storage.write_json(storage.join(workdir, "sweep.json"), sw)
  storage.write_text(storage.join(workdir, "sweep.md"), sweep_report.sweep_markdown(sw))
  print(f"sweep of seeds {sw['seeds']}: {storage.join(workdir, 'sweep.md')}", flush=True)
  return sw


def main(argv=None) -> int:
  args, overrides, seeds = parse(sys.argv[1:] if argv is None else argv)
  status = 0
  if not args.summarize_only:
    for s in seeds:
      print(f"[sweep] seed {s} -> {seed_dir(args.workdir, s)}", flush=True)
      cmd = [sys.executable, "-m", "experiments.run", "--config", args.config, *overrides,
             f"--config.seed={s}", "--workdir", seed_dir(args.workdir, s)]
      status = subprocess.run(cmd, check=False).returncode
      if status != 0:
        print(f"[sweep] seed {s} exited with status {status}; stopping the sweep (run the "
              "same command again to resume)", file=sys.stderr, flush=True)
        break
  try:
    summarize(args.workdir, seeds)
  except ValueError as e:  # no seed has a report yet
    print(f"[sweep] nothing to summarise: {e}", file=sys.stderr, flush=True)
    return status or 1
  return status


if __name__ == "__main__":
  sys.exit(main())
