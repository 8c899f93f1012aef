"""How much of an MOPD update is signal: eq. 15's sampled-token gradient against its exact
expectation (the `vocab_kl` gradient) on the same batches of the student's own rollouts.

    python -m experiments.mopd_noise --config configs/toy.py --workdir DIR \
        [--params mopd/init_params] [--batches 8] [--out noise.json]

Loads the params under `DIR/<params>` (the teacher-SFT init's student by default; `sft/params`
is pi_SFT, `mopd/params` the final student) of a run made with the same `--config` and
overrides, draws `--batches` MOPD batches as the stage draws them (the training prompts,
`mopd.prompts_per_cell` per cell, the student sampling with the effort in its prompt) and
prints, per batch and as a mean ± standard error over the batches:

- `cos_eq15_vocab`: the cosine between eq. 15's gradient (`mopd.r_max`'s clip) and the exact
  per-position expectation of it (`vocab_kl`, `mopd_jax/training/vocab_kl.py`) on the same batch;
- `cos_eq15_pairs`, `cos_vocab_pairs`: the cosine between the gradients of two independent
  batches under each loss (how much of a step's direction the next step repeats: what
  Adam's momentum keeps and its normalisation then scales to a full step of `mopd.lr`);
- `norm_ratio`: |eq. 15's gradient| / |vocab_kl's|;
- `tail_share_eq15`, `tail_share_vocab`: the share of each gradient's norm that comes from
  the batch's tail rows, the 5% of rollouts with the largest mean exact KL (the `agt`
  rollouts that call a name the prompt does not hold), and those rows' share of the KL;
- the per-rollout exact KL distribution of the batches (quantiles, the largest rollouts).
"""
import json

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_PARAMS = flags.DEFINE_string("params", "mopd/init_params", "Params under the workdir.")
_BATCHES = flags.DEFINE_integer("batches", 8, "MOPD batches to measure.")
_OUT = flags.DEFINE_string("out", "", "Write the measurements as JSON here.")

TAIL = 0.05  # the share of a batch's rollouts that forms its tail (largest mean exact KL)


def _flat(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _cos(a, b) -> float:
  return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def measure(inp, params, *, batches: int) -> dict:
  """The measurements listed in the module's docstring; `inp`: the run's `stages.mopd.Inputs`."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from mopd_jax.training import mopd  # pylint: disable=g-import-not-at-top
  from mopd_jax.teachers import bank as teachers
  from mopd_jax.training import step as train, vocab_kl
  c, grid = inp.cfg, inp.grid
  setup = mopd.StepSetup(inp.bank, inp.engine, inp.tasks, grid.cells, grid.taus, view=inp.view)
  shared = c.prompts_across_efforts == "shared"
  iters = {d: inp.data.iterator(d, c.prompts_per_cell * (1 if shared else len(grid.efforts)),
                           salt=900 + i) for i, d in enumerate(grid.domains)}
  eq15 = train.LossConfig(kind="mopd", r_max=c.r_max)
  eq15_grad = jax.jit(lambda p, b: train.loss_and_grads(inp.model_cfg, eq15, p, batch=b)[1])
  vocab_grad = jax.jit(lambda p, b, t, a: jax.grad(lambda q: vocab_kl.vocab_kl_loss(
      inp.model_cfg, q, inp.scoring.model_cfg, teacher_params_K=t, arrays=a, batch=b,
      loss_cfg=train.LossConfig(kind="vocab_kl", r_max=c.r_max))[0])(p))
  rows, grads = [], []
  for j in range(batches):
    per_cell = mopd.cell_prompts(iters, grid, c.prompts_per_cell, shared=shared)
    sampled = mopd.sample_batch(setup, params, per_cell, rng=jax.random.PRNGKey(7000 + j),
                                rows_per_teacher=c.prompts_per_cell)
    scored = np.asarray(inp.scorer.fetch(inp.scorer.submit(sampled.tokens, sampled.input_mask)))
    n = sampled.arr["tokens"].shape[0]
    teacher_lp = sampled.student_layout(teachers.scatter_stratified(scored, sampled.index, n))
    batch = mopd.train_batch(sampled.arr, teacher_lp)
    kl = vocab_kl.exact_kl_rows(inp.model_cfg, params, inp.scoring, sampled=sampled)
    mask = np.asarray(sampled.arr["loss_mask"], bool)
    row_kl = kl.sum(1) / np.maximum(mask.sum(1), 1)
    tail = row_kl >= np.quantile(row_kl, 1 - TAIL)
    arrays = vocab_kl.stratified(sampled, like=params)

    def grad_of(rows_kept, kind):
      b = batch.replace(loss_mask=batch.loss_mask & jnp.asarray(rows_kept)[:, None])
      if kind == "eq15":
        return _flat(eq15_grad(params, b))
      return _flat(vocab_grad(params, b, inp.scoring.params, arrays))

    everything = np.ones(n, bool)
    g = {k: grad_of(everything, k) for k in ("eq15", "vocab")}
    # A loss is a mean over rows: the tail's part is its rows' gradient scaled by their
    # share of the rows, and the rest's alike, so the two parts sum to the whole.
    share = tail.sum() / n
    part = {k: share * grad_of(tail, k) for k in ("eq15", "vocab")}
    grads.append(g)
    rows.append({
        "cos_eq15_vocab": _cos(g["eq15"], g["vocab"]),
        "norm_ratio": float(np.linalg.norm(g["eq15"]) / np.linalg.norm(g["vocab"])),
        "tail_share_eq15": float(np.linalg.norm(part["eq15"]) / np.linalg.norm(g["eq15"])),
        "tail_share_vocab": float(np.linalg.norm(part["vocab"]) / np.linalg.norm(g["vocab"])),
        "tail_share_kl": float(kl[tail].sum() / max(kl.sum(), 1e-30)),
        "row_kl": row_kl.tolist(),
        "tail_cells": [f"{grid.cells[i][0]}/{grid.cells[i][1]}"
                       for i in np.asarray(sampled.cell_ids)[tail[:len(sampled.cell_ids)]]]})
  for k in ("eq15", "vocab"):
    pairs = [_cos(grads[i][k], grads[i + 1][k]) for i in range(0, len(grads) - 1, 2)]
    for r, v in zip(rows[::2], pairs):
      r[f"cos_{k}_pairs"] = v
  summary = {}
  for key in ("cos_eq15_vocab", "cos_eq15_pairs", "cos_vocab_pairs", "norm_ratio",
              "tail_share_eq15", "tail_share_vocab", "tail_share_kl"):
    v = np.asarray([r[key] for r in rows if key in r])
    summary[key] = {"mean": float(v.mean()),
                    "se": float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0,
                    "n": len(v)}
  all_rows = np.concatenate([r["row_kl"] for r in rows])
  summary["row_kl_quantiles"] = {q: float(np.quantile(all_rows, float(q)))
                                 for q in ("0.5", "0.9", "0.99", "1.0")}
  summary["row_kl_top"] = sorted(all_rows.tolist())[-5:]
  return {"summary": summary, "batches": rows}


def main(argv):
  from mopd_jax.stages import wiring  # pylint: disable=g-import-not-at-top
  ctx, params = common.run_and_params(argv, config=_CONFIG.value, workdir=_WORKDIR.value,
                                      params=_PARAMS.value)
  out = measure(wiring.mopd_inputs(ctx), params, batches=_BATCHES.value)
  for key, v in out["summary"].items():
    print(f"{key}: {v}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
