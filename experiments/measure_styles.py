"""Accuracy and length of each reasoning style of the toy domains, after a style-tagged SFT.

    python -m experiments.measure_styles --out /tmp/styles.json

About 6 minutes on 2 CPU cores (data ~2 s, SFT 800 updates ~5.5 min including compiles,
greedy eval of the 9 (domain, style) cells ~20 s). This is the measurement behind the
per-style accuracy table of the README: "reasoning length buys accuracy" on every domain.

What it does:
  1. Builds the examples straight from the task code: per domain `get_task(d).generate(seed,
     num_train)` for training and `num_test` test examples from another stream whose prompts
     are disjoint from the training ones (`exclude`).
  2. Trains the toy model (`models.get_preset("toy", quant="int4")`: 4 layers, d_model 128,
     INT4 QAT) from scratch with SFT, one domain per step following `--schedule` (default
     gen,agt,cod,cod: cod's longer trace needs about 400 updates; each batch is padded
     only to its own longest sequence, rounded up to a multiple of 16). Effort tokens are
     tagged by style (`sft.sft_batch(..., draw=sft.SftDraw("style"))`): full -> <max>,
     brief -> <high>, direct -> <low>, each style drawn uniformly per example.
  3. Evaluates every (domain, style) cell greedily on the test examples, asking for the style
     with its effort token and a generous budget of `max_response_tokens` (so no style is cut
     short), and reports accuracy and mean response length (tokens, observations included).

Output: a table on stdout and, with `--out`, a JSON file
    {"results": {domain: {style: {"accuracy", "mean_length", "reference_length",
                                  "over_budget_rate"}}},
     "targets": {domain: {check: bool}}, "wall_time_s", "train_time_s", "eval_time_s",
     "settings": {...}, "loss": {domain: last logged loss}}
The targets: full accuracy >= 0.7, direct <= 0.6 x full, brief strictly between direct and
full in accuracy and in length.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
import time

import numpy as np

from mopd_jax.tasks import base as task_base

STYLES = task_base.STYLES  # full, brief, direct
DEFAULT_SCHEDULE = "gen,agt,cod,cod"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=800, help="SFT updates in all")
  p.add_argument("--batch_size", type=int, default=48, help="sequences per update")
  p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
  p.add_argument("--warmup_steps", type=int, default=20)
  p.add_argument("--weight_decay", type=float, default=0.0, help="AdamW (decoupled) decay")
  p.add_argument("--num_train", type=int, default=4000, help="training examples per domain")
  p.add_argument("--num_test", type=int, default=96, help="test examples per domain")
  p.add_argument("--domains", default="gen,agt,cod", help="comma-separated subset")
  p.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                 help="repeating domain sequence, one per update (empty: round-robin over "
                 "--domains)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--d_model", type=int, default=0, help="override the toy preset (0 = keep)")
  p.add_argument("--num_layers", type=int, default=0, help="override the toy preset (0 = keep)")
  p.add_argument("--model", default="", help="more preset overrides, e.g. qk_norm=0,mlp_dim=256")
  p.add_argument("--quant", default="int4", choices=("none", "int8", "int4"))
  p.add_argument("--max_response_tokens", type=int, default=96)
  p.add_argument("--log_every", type=int, default=50)
  p.add_argument("--show", type=int, default=0, help="print this many responses per cell")
  p.add_argument("--out", default="", help="write the JSON report here")
  args = p.parse_args(argv)
  args.domains = [d.strip() for d in args.domains.split(",") if d.strip()]
  for d in args.domains:
    task_base.validate_domain(d)
  if args.steps < 1 or args.batch_size < 1 or args.num_train < 1 or args.num_test < 1:
    raise SystemExit("--steps, --batch_size, --num_train and --num_test must be >= 1")
  return args


def build_data(domains, num_train: int, num_test: int, seed: int):
  """{domain: (train examples, test examples)}; test prompts never occur in train."""
  from mopd_jax.tasks import get_task  # pylint: disable=g-import-not-at-top
  data = {}
  for d in domains:
    task = get_task(d)
    train = task.generate(seed, num_train)
    test = task.generate(seed + 1, num_test, exclude={e.prompt for e in train})
    data[d] = (train, test)
  return data


def sequence_tokens(tok, example, style: str) -> int:
  """<bos> <effort> prompt \\n response <eos>: the length of one SFT sequence."""
  return 2 + len(tok.encode(example.prompt + "\n")) + len(tok.encode(
      example.solutions[style])) + 1


class RoundRobin:
  """Step s trains domain s % D on the next `batch_size` examples of that domain.

  Each domain walks through its training set in a fresh permutation per epoch; everything is a
  pure function of (seed, step).
  """

  def __init__(self, data: dict, batch_size: int, seed: int, schedule=None):
    self.domains = list(data)
    self.train = {d: data[d][0] for d in self.domains}
    self.batch_size, self.seed = batch_size, seed
    # The repeating sequence of domains, one per update (default: round-robin).
    self.schedule = list(schedule or self.domains)
    unknown = set(self.schedule) - set(self.domains)
    if unknown:
      raise ValueError(f"schedule names domains {sorted(unknown)} not in {self.domains}")
    self._perms = {}

  def _perm(self, di: int, epoch: int):
    key = (di, epoch)
    if key not in self._perms:
      n = len(self.train[self.domains[di]])
      self._perms[key] = np.random.RandomState([self.seed, di, epoch]).permutation(n)
    return self._perms[key]

  def domain(self, step: int) -> str:
    return self.schedule[step % len(self.schedule)]

  def __call__(self, step: int) -> list:
    d = self.domain(step)
    di = self.domains.index(d)
    exs = self.train[d]
    cycle, offset = divmod(step, len(self.schedule))
    drawn = cycle * self.schedule.count(d) + self.schedule[:offset].count(d)
    start = drawn * self.batch_size
    out = []
    for pos in range(start, start + self.batch_size):
      epoch, i = divmod(pos, len(exs))
      out.append(exs[int(self._perm(di, epoch)[i])])
    return out


def make_batch(tok, examples, rng, multiple: int = 16):
  """`sft.sft_batch` in style mode, padded to this batch's longest sequence (multiple of 16)."""
  from mopd_jax.training import sft  # pylint: disable=g-import-not-at-top
  bound = max(sequence_tokens(tok, e, "full") for e in examples)  # full is the longest style
  bound = -(-bound // multiple) * multiple
  batch = sft.sft_batch(tok, examples, rng, width=bound, draw=sft.SftDraw("style"))
  longest = int(np.asarray(batch.input_mask).sum(axis=1).max())
  width = -(-longest // multiple) * multiple
  if width < bound:
    batch = batch.replace(tokens=batch.tokens[:, :width],
                          input_mask=batch.input_mask[:, :width],
                          loss_mask=batch.loss_mask[:, :width])
  return batch


def check_targets(row: dict) -> dict:
  f, b, d = (row[s] for s in STYLES)
  return {
      "full_accuracy>=0.7": f["accuracy"] >= 0.7,
      "direct<=0.6*full": d["accuracy"] <= 0.6 * f["accuracy"],
      "direct<brief<full(accuracy)": d["accuracy"] < b["accuracy"] < f["accuracy"],
      "direct<brief<full(length)": d["mean_length"] < b["mean_length"] < f["mean_length"],
  }


def format_table(results: dict) -> str:
  lines = [f"{'domain':6s} {'style':6s} {'accuracy':>8s} {'length':>7s} {'ref_len':>7s}"]
  for d, row in results.items():
    for s in STYLES:
      r = row[s]
      lines.append(f"{d:6s} {s:6s} {r['accuracy']:8.3f} {r['mean_length']:7.1f} "
                   f"{r['reference_length']:7.1f}")
  return "\n".join(lines)


def main(argv=None) -> dict:
  args = parse_args(argv)
  t_start = time.time()
  import jax  # pylint: disable=g-import-not-at-top

  from mopd_jax import models  # pylint: disable=g-import-not-at-top
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.runtime import sharding
  from mopd_jax.training import sft, step as train
  from mopd_jax.tasks import get_task  # pylint: disable=g-import-not-at-top
  from mopd_jax.io.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top

  tok = CharTokenizer()
  overrides = {k: getattr(args, k) for k in ("d_model", "num_layers") if getattr(args, k)}
  for item in filter(None, args.model.split(",")):
    key, value = item.split("=")
    overrides[key.strip()] = type(getattr(models.get_preset("toy"), key.strip()))(ast.literal_eval(value))
  cfg = models.get_preset("toy", quant=args.quant, **overrides)
  data = build_data(args.domains, args.num_train, args.num_test, args.seed)
  seq_max = {d: max(sequence_tokens(tok, e, "full") for e in tr) for d, (tr, _) in data.items()}
  print(f"data: {', '.join(f'{d} {len(tr)}+{len(te)}' for d, (tr, te) in data.items())}; "
        f"longest sequence (full style) {seq_max}; {time.time() - t_start:.1f}s", flush=True)

  mesh = sharding.make_mesh({}, jax.devices()[:1])
  trainer = train.Trainer(cfg, train.LossConfig(kind="sft"),
                          train.OptimConfig(lr=args.lr, warmup_steps=args.warmup_steps,
                                            weight_decay=args.weight_decay,
                                            total_steps=args.steps), mesh=mesh)
  state = trainer.init(models.init_params(cfg, jax.random.PRNGKey(args.seed)))
  # The default schedule names all three domains; with a --domains subset, its own entries.
  schedule = [d for d in args.schedule.split(",") if d]
  if args.schedule == DEFAULT_SCHEDULE:
    schedule = [d for d in schedule if d in args.domains]
  batches = RoundRobin(data, args.batch_size, args.seed, schedule or None)
  recent = {d: [] for d in args.domains}
  t_train = time.time()
  for step in range(args.steps):
    rng = np.random.RandomState([args.seed, step])
    state, m = trainer.step(state, make_batch(tok, batches(step), rng))
    loss = float(m["loss"])
    if not np.isfinite(loss):
      raise FloatingPointError(f"step {step}: non-finite loss {loss}")
    recent[batches.domain(step)] = (recent[batches.domain(step)] + [loss])[-10:]
    if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
      losses = " ".join(f"{d} {np.mean(v):.3f}" for d, v in recent.items() if v)
      print(f"step {step + 1}/{args.steps} loss {losses} ({time.time() - t_train:.0f}s)",
            flush=True)
  jax.block_until_ready(state.params)
  train_time = time.time() - t_train

  t_eval = time.time()
  engine = rollout.RolloutEngine(cfg, tok, max_response_tokens=args.max_response_tokens,
                                 decode=rollout.DecodeOptions(temperature=0.0))
  results = {}
  for d, (_, test) in data.items():
    task = get_task(d)
    results[d] = {}
    for style in STYLES:
      r = sft.evaluate(engine, state.params, task, examples=test,
                       effort=sft.STYLE_EFFORT[style],
                       budgets=[args.max_response_tokens] * len(test),
                       rng=jax.random.PRNGKey(args.seed), batch_size=len(test))
      ref = float(np.mean([len(tok.encode(e.solutions[style])) + 1 for e in test]))
      if args.show:
        res = engine.run(state.params, test[:args.show], [sft.STYLE_EFFORT[style]] * args.show,
                         budgets=[args.max_response_tokens] * args.show,
                         rng=jax.random.PRNGKey(args.seed),
                         environment=task.environment)
        for e, text in zip(test, res.texts):
          print(f"  [{d}/{style}] {e.prompt!r} -> {text!r} "
                f"({'ok' if task.verify(e, text) else 'wrong'}; ref {e.answer!r})")
      results[d][style] = {"accuracy": r["accuracy"], "mean_length": r["mean_length"],
                           "reference_length": ref, "over_budget_rate": r["over_budget_rate"]}
  eval_time = time.time() - t_eval
  wall = time.time() - t_start

  report = {
      "results": results,
      "targets": {d: check_targets(row) for d, row in results.items()},
      "wall_time_s": round(wall, 1), "train_time_s": round(train_time, 1),
      "eval_time_s": round(eval_time, 1),
      "loss": {d: float(np.mean(v)) for d, v in recent.items() if v},
      "longest_sequence_tokens": seq_max,
      "settings": {k: v for k, v in vars(args).items() if k != "out"},
      "model": {"d_model": cfg.d_model, "num_layers": cfg.num_layers, "quant": cfg.quant},
      "command": "python -m experiments.measure_styles " + " ".join(
          sys.argv[1:] if argv is None else argv),
  }
  print(format_table(results))
  for d, checks in report["targets"].items():
    print(f"{d}: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in checks.items()))
  print(f"wall time {wall:.0f}s (train {train_time:.0f}s, eval {eval_time:.0f}s)", flush=True)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(report, fh, indent=2, sort_keys=True)
  return report


if __name__ == "__main__":
  main()
