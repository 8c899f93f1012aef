"""What teachers of another tokenizer add to a toy MOPD step: `python -m benchmarks.cross_tokenizer
[--steps 6] [--prompts_per_cell 6] [--vocab 512]`.

A toy-shaped student (the character tokenizer) and nine toy-shaped teachers of a byte-level BPE
fitted on the toy tasks' text (`mopd_jax/io/bpe.py`) take whole MOPD steps as the stage takes
them (`mopd.sample_batch`, the bank's scoring, `mopd.train_on` with eq. 15) on the toy's grid
at the toy's batch (6 prompts per cell, 54 rollouts). The host-side work of the other
tokenizer, timed inside the same steps, is moving each response into the teachers' tokens and
laying out their batch (`alignment.cross_view`) and turning the teachers' per-token log-probs
into eq. 15's per-span rewards (`alignment.cross_teacher_logprobs`). With `--loss char_kl` the
steps train on the teachers' next-character distributions instead, and their building
(`char_marginal.topk_of`: the teachers' full passes, the partial tokens' branches and the
host work) is timed too. Printed as one JSON line: the median step's seconds, the median
seconds of each part, and their share of the step. The
student is freshly initialised, so its rollouts run to the length cap: the longest texts to
align, the heaviest case for the host-side part.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time

import jax
import numpy as np

from mopd_jax import models
from mopd_jax.config.tokenizer_options import TokenizerOptions
from mopd_jax.io import bpe
from mopd_jax.io.tokenizer import SPECIALS, CharTokenizer, load_tokenizer
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import sharding
from mopd_jax.tasks import base as task_base
from mopd_jax.teachers import alignment, bank as teachers, char_marginal
from mopd_jax.training import mopd, step as train

DOMAINS, EFFORTS = ("gen", "agt", "cod"), ("low", "high", "max")
TAUS = {"low": 0.25, "high": 0.55, "max": 1.0}


class _Timed:
  """Wraps a module function so that its calls' wall seconds add up in `seconds`."""

  def __init__(self, module, name: str):
    self.module, self.name, self.fn, self.seconds = module, name, getattr(module, name), 0.0

  def __enter__(self):
    @functools.wraps(self.fn)
    def timed(*args, **kwargs):
      t = time.perf_counter()
      try:
        return self.fn(*args, **kwargs)
      finally:
        self.seconds += time.perf_counter() - t
    setattr(self.module, self.name, timed)
    return self

  def __exit__(self, *exc):
    setattr(self.module, self.name, self.fn)


def step_shares(*, steps: int = 6, prompts_per_cell: int = 6, vocab: int = 512,
                max_response_tokens: int = 96, d_model: int = 0, loss: str = "mopd") -> dict:
  """Median seconds of a whole MOPD step and of its cross-tokenizer parts, and their share
  of the step, over `steps` steps after one warm-up step (its compilation); `loss`: "mopd"
  (eq. 15 by spans) or "char_kl" (adds the next-character targets' part)."""
  texts = []
  for d in DOMAINS:
    for ex in task_base.get_task(d, domain=d).generate(10_000, 500):
      texts.append(ex.prompt)
      texts.extend(ex.solutions.values())
  path = bpe.fit(texts, os.path.join(tempfile.mkdtemp(), "tokenizer.json"), vocab_size=vocab,
                 specials=SPECIALS)
  tok, teacher_tok = CharTokenizer(), load_tokenizer(path, options=TokenizerOptions(chat=False))
  shape = {"d_model": d_model} if d_model else {}
  cfg = models.get_preset("toy", vocab_size=tok.vocab_size, **shape)
  tcfg = models.get_preset("toy", vocab_size=teacher_tok.vocab_size, **shape)
  cells = [(d, e) for d in DOMAINS for e in EFFORTS]
  bank = teachers.build_bank(tcfg, {f"{d}/{e}": models.init_params(tcfg, jax.random.PRNGKey(i))
                                    for i, (d, e) in enumerate(cells)})
  tasks = {d: task_base.get_task(d, domain=d) for d in DOMAINS}
  pools = {d: tasks[d].generate(1, prompts_per_cell * (steps + 1)) for d in DOMAINS}
  setup = mopd.StepSetup(bank, rollout.RolloutEngine(cfg, tok,
                                                     max_response_tokens=max_response_tokens),
                         tasks, cells, TAUS, teacher_tok=teacher_tok)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  trainer = train.Trainer(cfg, train.LossConfig(kind=loss, r_max=5.0),
                          train.OptimConfig(lr=3e-4, warmup_steps=0, total_steps=steps + 1),
                          mesh=mesh)
  state = trainer.init(models.init_params(cfg, jax.random.PRNGKey(100)))
  rows = {"step": [], "cross_view": [], "cross_teacher_logprobs": [], "char_targets": []}
  for step in range(steps + 1):
    per_cell = [pools[d][step * prompts_per_cell:(step + 1) * prompts_per_cell]
                for d, _ in cells]
    with _Timed(alignment, "cross_view") as view, \
        _Timed(alignment, "cross_teacher_logprobs") as rewards, \
        _Timed(char_marginal, "topk_of") as chars:
      t = time.perf_counter()
      sampled = mopd.sample_batch(setup, state.params, per_cell,
                                  rng=jax.random.PRNGKey(step))
      scored = teachers.score_stratified(bank, sampled.tokens, sampled.input_mask)
      state, _ = mopd.train_on(trainer, state, bank, sampled=sampled, scored=scored, r_max=5.0)
      jax.block_until_ready(state.params)
      elapsed = time.perf_counter() - t
    if step:  # the first step compiles
      rows["step"].append(elapsed)
      rows["cross_view"].append(view.seconds)
      rows["cross_teacher_logprobs"].append(rewards.seconds)
      rows["char_targets"].append(chars.seconds)
  med = {k: float(np.median(v)) for k, v in rows.items()}
  both = float(np.median(np.add(rows["cross_view"], rows["cross_teacher_logprobs"])))
  return {"step_s": med["step"], "cross_view_s": med["cross_view"],
          "cross_teacher_logprobs_s": med["cross_teacher_logprobs"],
          "alignment_share_of_step": float(np.median(
              np.add(rows["cross_view"], rows["cross_teacher_logprobs"]) /
              np.asarray(rows["step"]))),
          "alignment_s": both, "rollouts_per_step": prompts_per_cell * len(cells),
          "steps": steps, "loss": loss,
          **({"char_targets_s": med["char_targets"], "char_targets_share_of_step": float(
              np.median(np.asarray(rows["char_targets"]) / np.asarray(rows["step"])))}
             if loss == "char_kl" else {})}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.cross_tokenizer",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--prompts_per_cell", type=int, default=6)
  ap.add_argument("--vocab", type=int, default=512)
  ap.add_argument("--loss", default="mopd", choices=("mopd", "char_kl"))
  args = ap.parse_args(argv)
  print(json.dumps(step_shares(steps=args.steps, prompts_per_cell=args.prompts_per_cell,
                               vocab=args.vocab, loss=args.loss)), flush=True)


if __name__ == "__main__":
  main()
