"""Where a policy's held-out exact KL comes from: its rollouts ranked by their mean exact KL to
the routed teachers, with each token's KL.

    python -m experiments.kl_tail --config configs/toy.py --workdir DIR \
        [--params mopd/params] [--prompts 128] [--top 12] [--temperature 1] [--off_track 5]
        [--out tail.json]

Loads the params under `DIR/<params>` (the final student by default; `mopd/init_params` is
the initialised student, `sft/params` pi_SFT) of a run made with the same `--config` and
overrides, samples them after the first `--prompts` test prompts of each domain at every
effort exactly as the eval's held-out KL does (`agreement.heldout_batches`: the same
prompts, batches and keys, so the mean printed first equals the eval's), and prints the
cells of the top 1% of rollouts, each cell's onsets (`agreement.kl_onsets`: its worst
response positions and the share of the KL carried by the rows above `--onset` nats there),
the rollouts with a token above `--off_track` nats (their count, cells, lengths and share
of the summed KL), then the `--top` rollouts: cell, mean KL, prompt, and every generated
token with its exact KL against the teacher at the scoring temperature. A rollout that
leaves the teacher's track shows as a token sampled at a small KL followed by tokens whose
KL is several nats. With teachers of another tokenizer (`configs/toy.py:cross_tokenizer`)
the measure is the eval's there, the sampled log-ratio: each aligned span's log pi - log
pi_T spread over its tokens (`agreement.logratio_rows`). `--temperature` divides the
policy's logits (its final norm scale) before it samples and is scored: a policy whose KL
falls when sharpened is under-confident against its teachers.
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
_PARAMS = flags.DEFINE_string("params", "mopd/params", "Params under the workdir.")
_PROMPTS = flags.DEFINE_integer("prompts", 128, "Test prompts per domain (at every effort).")
_TOP = flags.DEFINE_integer("top", 12, "Rollouts to print.")
_OUT = flags.DEFINE_string("out", "", "Write the ranked rollouts as JSON here.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sample and score the policy with its "
                                   "logits divided by this (`models.with_temperature`): how "
                                   "far a sharper or flatter policy is from its teachers.")
flags.register_validator("temperature", lambda t: t > 0, message="--temperature must be > 0")
_ONSET = flags.DEFINE_float("onset", 0.5, "A row's KL at one of its cell's worst positions "
                            "above which `agreement.kl_onsets` counts it as leaving the track.")
_OFF_TRACK = flags.DEFINE_float("off_track", 5.0, "A rollout with a token whose KL is above "
                                "this many nats counts as off the teacher's track.")



def ranked(inp, ctx, params, *, prompts: int) -> dict:
  """{"kl_exact": the token mean, "top1pct_cells": {cell: count}, "rollouts": [{"cell",
  "mean_kl", "prompt", "tokens": [[text, kl], ...]}, ...] largest mean first}."""
  import jax  # pylint: disable=g-import-not-at-top
  from mopd_jax.evaluation import agreement  # pylint: disable=g-import-not-at-top
  from mopd_jax.training import mopd
  grid = inp.grid
  setup = mopd.StepSetup(inp.bank, inp.engine, inp.tasks, grid.cells, grid.taus, view=inp.view,
                         teacher_tok=inp.teacher_tok if inp.cross else None)
  examples = {}
  for d in grid.domains:
    test = ctx.data.split(d, "test")
    examples[d] = [test[i] for i in range(min(prompts, len(test)))]
  rows, kl_sum, tok_sum = [], 0.0, 0
  rng = jax.random.PRNGKey(agreement.HELDOUT_KEY)
  for sampled, kl in agreement.heldout_batches(inp.model_cfg, params, setup, scoring=inp.scoring,
                                               examples=examples, rng=rng):
    mask = agreement.measured_mask(sampled)  # less the rows the teachers could not take
    tokens = np.asarray(sampled.arr["tokens"])
    for r in range(len(sampled.lengths)):
      pos = np.where(mask[r])[0]
      if not len(pos):
        continue
      d, e = setup.cells[sampled.cell_ids[r]]
      kl_sum += float(kl[r][pos].sum())
      tok_sum += len(pos)
      rows.append({"cell": f"{d}/{e}", "mean_kl": float(kl[r][pos].mean()),
                   "prompt": inp.tok.decode([int(t) for t in tokens[r, :pos[0]]
                                             if t != inp.tok.pad_id]),
                   "tokens": [[inp.tok.decode([int(tokens[r, p])]), float(kl[r, p])]
                              for p in pos]})
  rows.sort(key=lambda x: -x["mean_kl"])
  top = rows[:max(1, len(rows) // 100)]
  return {"kl_exact": kl_sum / max(tok_sum, 1), "rollouts": len(rows),
          "top1pct_cells": dict(collections.Counter(r["cell"] for r in top)), "ranked": rows}


def off_track(rows, *, threshold: float) -> dict:
  """The rollouts of `rows` (`ranked`'s) with a token whose KL is above `threshold` nats:
  {"rollouts": their count, "cells": {cell: count}, "lengths": their token counts, sorted,
  "share": their share of the summed KL over every row's tokens}. Two policies with the same
  count and different shares differ in what follows the token that left the track."""
  off = [r for r in rows if any(k > threshold for _, k in r["tokens"])]
  total = sum(k for r in rows for _, k in r["tokens"])
  part = sum(k for r in off for _, k in r["tokens"])
  return {"rollouts": len(off), "cells": dict(collections.Counter(r["cell"] for r in off)),
          "lengths": sorted(len(r["tokens"]) for r in off),
          "share": part / total if total > 0 else 0.0}


def main(argv):
  from mopd_jax import models  # pylint: disable=g-import-not-at-top
  from mopd_jax.stages import wiring  # pylint: disable=g-import-not-at-top
  ctx, params = common.run_and_params(argv, config=_CONFIG.value, workdir=_WORKDIR.value,
                                      params=_PARAMS.value)
  inp = wiring.mopd_inputs(ctx)
  params = models.with_temperature(params, _TEMPERATURE.value)
  out = ranked(inp, ctx, params, prompts=_PROMPTS.value)
  from mopd_jax.evaluation import agreement  # pylint: disable=g-import-not-at-top
  measure = agreement.MEASURES["sampled" if inp.cross else "exact"]  # as the eval names it
  print(f"{measure} over {out['rollouts']} rollouts: {out['kl_exact']:.4f}")
  print(f"cells of the top 1% of rollouts: {out['top1pct_cells']}")
  out["off_track"] = off_track(out["ranked"], threshold=_OFF_TRACK.value)
  o = out["off_track"]
  print(f"rollouts with a token above {_OFF_TRACK.value} nats: {o['rollouts']} {o['cells']}, "
        f"{o['share']:.2f} of the summed KL, lengths {o['lengths']}")
  by_cell = collections.defaultdict(list)
  for r in out["ranked"]:
    by_cell[r["cell"]].append([k for _, k in r["tokens"]])
  out["onsets"] = agreement.kl_onsets(dict(by_cell), threshold=_ONSET.value)
  for cell, positions in out["onsets"].items():
    print(f"{cell} ({positions[0]['rows']} rows), response positions with the largest mean "
          f"KL; rows above {_ONSET.value} nats there, their share of the cell's KL / of all: " +
          "; ".join(f"{o['position']}: {o['mean_kl']:.3f}, {o['rows_above']} rows, "
                    f"{o['share_of_cell']:.2f} / {o['share_of_all']:.2f}" for o in positions))
  for r in out["ranked"][:_TOP.value]:
    print(f"--- {r['cell']} mean KL {r['mean_kl']:.3f} after {r['prompt']!r}")
    print("    " + " ".join(f"{t!r}:{k:.2f}" for t, k in r["tokens"]))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
