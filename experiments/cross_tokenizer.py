"""Distillation from teachers of another tokenizer on the toy, every stage, several seeds:

    python -m experiments.cross_tokenizer --seeds 0,1,2,3,4 --workdir DIR [--vocab 512]

For each seed s:
  1. a byte-level BPE of `--vocab` tokens fitted on the toy tasks' text (prompts and reference
     responses of `--corpus` examples per task, drawn from seed 10000 + s, so no split of the
     run is read), the toy's specials first, no token holding two digits (`bpe.DIGITS_APART`:
     the toy's arithmetic is one digit per step; docs/cross_tokenizer.md)
     (`DIR/bpe_<s>/tokenizer.json`);
  2. the teacher factory in that tokenizer: `configs/toy.py` with `model.tokenizer_path` the
     BPE, stages data, sft and rl (`DIR/factory_<s>`): its own pi_SFT, its own RL teachers,
     each response counted against its budget in the student's (character) tokens
     (`budget.count_with=char`: the toy's b0 is in characters), so the teachers learn the
     budgets the student is held to;
  3. the nine teachers exported as Hugging Face checkpoints (`DIR/factory_<s>/hf/<cell>`, at
     temperature 1: the student's run applies `mopd.teacher_temperature`);
  4. the student, character-level, every stage of `configs/toy.py:cross_tokenizer` with those
     teachers (`teacher.hf_paths`, `teacher.tokenizer_path`) in `DIR/seed_<s>`.
With `--char_cells cod/low,cod/high,cod/max` those cells' teachers come from a
character-level factory instead (`configs/toy.py`'s data, SFT and RL stages in
`DIR/char_factory_<s>`, exported): the student's run has teachers of two families, the BPE
cells named in `teacher.tokenizer_paths` (docs/cross_tokenizer.md, "Teachers of several
families"). `--config configs/toy.py:two_families` distils with eq. 15 by aligned spans
instead of `char_kl` (the comparison docs/cross_tokenizer.md reports).
Then `DIR/sweep.md` (experiments.sweep's summary of the students' reports) and
`DIR/cross_tokenizer.md`: per seed, the share of the teachers' tokens that span two or more
characters, the rows the teachers could not take, the held-out sampled log-ratio of pi_SFT,
the initialised and the final student, the student's span log-ratio over its first and last
tenth of MOPD steps, and the student's expected results met. Every step resumes: finished
stages are skipped. Extra `--config.field=value` flags go to the student's runs.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import numpy as np

from experiments import sweep
from mopd_jax.io import checkpoint, storage

TASKS = ("gen", "agt", "cod")


def corpus(seed: int, n: int) -> list:
  """The BPE's training text: prompts and reference responses of `n` examples per task."""
  from mopd_jax.tasks import base  # pylint: disable=g-import-not-at-top
  texts = []
  for name in TASKS:
    for ex in base.get_task(name, domain=name).generate(10_000 + seed, n):
      texts.append(ex.prompt)
      texts.extend(ex.solutions.values())
  return texts


def fit_tokenizer(workdir: str, seed: int, *, vocab: int, n: int) -> tuple:
  """(the BPE's tokenizer.json, the share of its tokens of the corpus spanning 2+ chars)."""
  from mopd_jax.config.tokenizer_options import TokenizerOptions  # pylint: disable=g-import-not-at-top
  from mopd_jax.io import bpe  # pylint: disable=g-import-not-at-top
  from mopd_jax.io.tokenizer import SPECIALS, load_tokenizer  # pylint: disable=g-import-not-at-top
  path = storage.join(workdir, f"bpe_{seed}", "tokenizer.json")
  texts = corpus(seed, n)
  if not storage.exists(path):
    bpe.fit(texts, path, vocab_size=vocab, specials=SPECIALS, digits_apart=True)
  tok = load_tokenizer(path, options=TokenizerOptions(chat=False))
  return path, bpe.multi_char_share(tok, texts)


def run(args: list) -> None:
  print("+ python -m experiments.run " + " ".join(args), flush=True)
  proc = subprocess.run([sys.executable, "-m", "experiments.run", *args])
  if proc.returncode:
    raise SystemExit(proc.returncode)


def export(factory: str, config: str, overrides: list) -> dict:
  """{cell: directory} of the factory's teachers as Hugging Face checkpoints at temperature
  1 (`python -m mopd_jax.serve --export_dir`)."""
  out = storage.join(factory, "hf")
  done = storage.join(out, "cells.json")
  if not storage.exists(done):
    cmd = [sys.executable, "-m", "mopd_jax.serve", "--config", config, "--teachers",
           storage.join(factory, "teachers.json"), "--export_dir", out,
           "--config.mopd.teacher_temperature=1.0", *overrides]
    print("+ " + " ".join(cmd[1:]), flush=True)
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode:
      raise SystemExit(f"exporting the teachers of {factory} failed")
    from mopd_jax.tasks import grid as grid_mod  # pylint: disable=g-import-not-at-top
    grid = grid_mod.Grid.from_json(checkpoint.read_json(
        storage.join(factory, "teachers.json"))["grid"])
    checkpoint.write_json(done, {c: storage.join(out, c.replace("/", "_")) for c in grid.names})
  return checkpoint.read_json(done)


def summary(workdir: str, rows: list) -> str:
  lines = ["| seed | teachers' tokens of 2+ chars (MOPD rollouts) | rows not aligned | held-out "
           "log-ratio per token, pi_SFT / initialised / final (± s.e.) | its median rollout, "
           "initialised / final | its 99th percentile, initialised / final | span log-ratio, "
           "first / last tenth of the MOPD steps | student results met | other results missed |",
           "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    held = " / ".join(f"{h[0]:.3f} ± {h[1]:.3f}" for h in r["heldout"]) or "-"
    tails = [" / ".join(f"{t[q]:.4f}" for t in r["tails"]) or "-" for q in ("p50", "p99")]
    met = f"{r['student_met']} of {r['student_total']}"
    if r["student_missed"]:
      met += ": missed " + "; ".join(r["student_missed"])
    lines.append(f"| {r['seed']} | {r['multi']:.2f} | {r['unaligned']:.0f} | {held} | "
                 f"{tails[0]} | {tails[1]} | {r['first']:.3f} / {r['last']:.3f} | {met} | "
                 f"{'; '.join(r['missed']) or 'none'} |")
  text = "\n".join(lines) + "\n"
  storage.write_text(storage.join(workdir, "cross_tokenizer.md"), text)
  return text


def seed_row(workdir: str, seed: int, multi: float) -> dict:
  """One seed's row of the summary: the student's expected results (`student ...` rows of its
  report), the others missed, the held-out sampled log-ratio of pi_SFT, the initialised
  and the final student (`agreement.logratio_rows`) with the per-rollout distribution of the
  last two (`tail`: its median and 99th percentile), and the MOPD steps' span log-ratio."""
  student = sweep.seed_dir(workdir, seed)
  history = checkpoint.read_json(storage.join(student, "mopd", "history.json"))
  kl = np.asarray([h["kl"] for h in history])
  tenth = max(1, len(kl) // 10)
  report = checkpoint.read_json(storage.join(student, "report.json"))
  checks = [c for c in report.get("checks", []) if c.get("ok") is not None]
  mine = [c for c in checks if c["name"].startswith("student ")]
  held = report.get("kl_heldout") or {}
  shares = [h["teacher_multi_token_share"] for h in history if "teacher_multi_token_share" in h]
  return {"seed": seed, "multi": float(np.mean(shares)) if shares else multi,
          "first": float(kl[:tenth].mean()),
          "last": float(kl[-tenth:].mean()),
          "unaligned": float(sum(h.get("unaligned_rows", 0.0) for h in history)),
          "heldout": [(held[p]["kl_exact"], held[p]["kl_exact_se"])
                      for p in ("sft", "init", "student") if p in held],
          "tails": [held[p]["tail"] for p in ("init", "student") if "tail" in held.get(p, {})],
          "student_met": sum(c["ok"] is True for c in mine), "student_total": len(mine),
          "student_missed": [c["name"] for c in mine if c["ok"] is False],
          "missed": [c["name"] for c in checks if c["ok"] is False and c not in mine]}


def two_families(args, seed: int, cells: dict, *, char: list, tokenizer: str) -> tuple:
  """({cell: checkpoint}, the student's tokenizer flags) of a run with teachers of two
  families: the `char` cells' teachers from the character-level factory (`--factory_config`
  as it is, `DIR/char_factory_<s>`: the main job's data, SFT and RL stages), exported; the
  other cells' from the BPE factory, named in `teacher.tokenizer_paths`."""
  unknown = sorted(set(char) - set(cells))
  if unknown:
    raise SystemExit(f"--char_cells names {unknown}, not cells of the grid {sorted(cells)}")
  factory = storage.join(args.workdir, f"char_factory_{seed}")
  run(["--config", args.factory_config, "--workdir", factory, f"--config.seed={seed}",
       "--config.stages=data,sft,rl"])
  own = export(factory, args.factory_config, [f"--config.seed={seed}"])
  paths = {c: own[c] if c in char else p for c, p in cells.items()}
  return paths, ["--config.teacher.tokenizer_paths=" + ",".join(
      f"{c}={tokenizer}" for c in cells if c not in char)]


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m experiments.cross_tokenizer",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--vocab", type=int, default=512, help="the BPE's vocabulary size")
  ap.add_argument("--corpus", type=int, default=2000, help="examples per task fitted on")
  ap.add_argument("--factory_config", default="configs/toy.py",
                  help="the teacher factory's config (its tokenizer is set to the BPE)")
  ap.add_argument("--config", default="configs/toy.py:cross_tokenizer",
                  help="the student's config (configs/toy.py:two_families: eq. 15 by spans)")
  ap.add_argument("--char_cells", default="",
                  help="cells (d/e,...) whose teachers come from a character-level factory "
                       "(the student's tokenizer): teachers of two families in one run")
  args, rest = ap.parse_known_args(argv)
  bad = [a for a in rest if not (a.startswith("--config.") and "=" in a)]
  if bad:
    ap.error(f"unexpected arguments {bad}; config overrides take the form --config.field=value")
  seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  char = [c.strip() for c in args.char_cells.split(",") if c.strip()]
  student_config = args.config
  rows = []
  for seed in seeds:
    tokenizer, multi = fit_tokenizer(args.workdir, seed, vocab=args.vocab, n=args.corpus)
    print(f"[cross_tokenizer] seed {seed}: {tokenizer}, {multi:.2f} of the teachers' tokens "
          "span 2+ characters", flush=True)
    factory = storage.join(args.workdir, f"factory_{seed}")
    made_with = [f"--config.seed={seed}", f"--config.model.tokenizer_path={tokenizer}"]
    run(["--config", args.factory_config, "--workdir", factory, *made_with,
         "--config.budget.count_with=char", "--config.stages=data,sft,rl"])
    cells = export(factory, args.factory_config, made_with)
    tokenizers = [f"--config.teacher.tokenizer_path={tokenizer}"]
    if char:
      cells, tokenizers = two_families(args, seed, cells, char=char, tokenizer=tokenizer)
    run(["--config", student_config, "--workdir",
         sweep.seed_dir(args.workdir, seed), f"--config.seed={seed}",
         "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in cells.items()),
         *tokenizers, *rest])
    rows.append(seed_row(args.workdir, seed, multi))
  sweep.summarize(args.workdir, seeds)
  print(summary(args.workdir, rows), flush=True)


if __name__ == "__main__":
  main()
