"""What eq. 15's reward clip removes from the `vocab_kl` gradient of a policy, per cell.

    python -m experiments.clip_share --config configs/toy.py --workdir DIR \
        [--params mopd/params] [--prompts 32] [--out shares.json]

Loads the params under `DIR/<params>` (`sft/params` is pi_SFT, where MOPD from pi_SFT
starts) of a run made with the same `--config` and overrides, samples them after the first
`--prompts` test prompts of each domain at every effort as the eval's held-out KL does
(`agreement.heldout_batches`), and prints per (domain, effort) cell, each rollout's tokens
weighted 1/|y| as the loss weights them (`vocab_kl.clip_share_rows`): the share of the
squared norm of the logits' gradient of the exact KL carried by the tokens more than
`mopd.r_max` nats from their teacher's log-prob (`beyond`), the clipped expectation's norm
over the KL's own (`clip / kl`), and the cell's share of the whole gradient, unclipped and
clipped (`cell share`). Each token's logits gradient is the one the loss backpropagates;
their squared norms summed are not the params' gradient's norm, but say which tokens drive it.
"""
import collections
import json

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_PARAMS = flags.DEFINE_string("params", "sft/params", "Params under the workdir.")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "Test prompts per domain (at every effort).")
_OUT = flags.DEFINE_string("out", "", "Write the per-cell figures as JSON here.")


def shares(sums: dict) -> dict:
  """{cell: {"tokens", "beyond", "clip_over_kl", "cell_share", "cell_share_clipped"}} and
  "all", from per-cell sums [tokens, |g|^2, |g beyond|^2, |g_clip|^2]."""
  total = np.sum(list(sums.values()), axis=0)
  out = {}
  for cell, v in sorted(sums.items()) + [("all", total)]:
    out[cell] = {"tokens": int(v[0]), "beyond": float(v[2] / max(v[1], 1e-30)),
                 "clip_over_kl": float(np.sqrt(v[3] / max(v[1], 1e-30))),
                 "cell_share": float(v[1] / max(total[1], 1e-30)),
                 "cell_share_clipped": float(v[3] / max(total[3], 1e-30))}
  return out


def main(argv):
  import jax  # pylint: disable=g-import-not-at-top
  from mopd_jax.evaluation import agreement  # pylint: disable=g-import-not-at-top
  from mopd_jax.stages import wiring  # pylint: disable=g-import-not-at-top
  from mopd_jax.training import mopd, vocab_kl  # pylint: disable=g-import-not-at-top
  ctx, params = common.run_and_params(argv, config=_CONFIG.value, workdir=_WORKDIR.value,
                                      params=_PARAMS.value)
  inp = wiring.mopd_inputs(ctx)
  if inp.cross:
    raise app.UsageError("teachers of another tokenizer have no whole-vocabulary KL to clip")
  grid, r_max = inp.grid, ctx.config.mopd.r_max
  setup = mopd.StepSetup(inp.bank, inp.engine, inp.tasks, grid.cells, grid.taus, view=inp.view)
  examples = {}
  for d in grid.domains:
    test = ctx.data.split(d, "test")
    examples[d] = [test[i] for i in range(min(_PROMPTS.value, len(test)))]
  sums = collections.defaultdict(lambda: np.zeros(4))
  for sampled, _ in agreement.heldout_batches(
      inp.model_cfg, params, setup, scoring=inp.scoring, examples=examples,
      rng=jax.random.PRNGKey(agreement.HELDOUT_KEY)):
    rows = vocab_kl.clip_share_rows(inp.model_cfg, params, inp.scoring, sampled=sampled,
                                    r_max=r_max)
    mask = agreement.measured_mask(sampled)
    for r in range(len(sampled.lengths)):
      n = int(mask[r].sum())
      if n:
        d, e = setup.cells[sampled.cell_ids[r]]
        w = rows[r][mask[r] > 0].sum(0) / n ** 2  # the loss's 1/|y|, squared
        sums[f"{d}/{e}"] += np.concatenate([[n], w])
  out = shares(sums)
  print(f"r_max {r_max}; per cell: tokens, beyond (share of |g|^2 on tokens beyond the "
        "clip), clip / kl (norm), cell share of the gradient (unclipped / clipped)")
  for cell, v in out.items():
    print(f"{cell}: {v['tokens']}, {v['beyond']:.3f}, {v['clip_over_kl']:.3f}, "
          f"{v['cell_share']:.3f} / {v['cell_share_clipped']:.3f}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
