"""How closely a policy's own answers follow its cell's teacher on held-out prompts.

For each response y of a policy pi to a prompt x (its greedy or sampled answer in the eval
stage), the mean over y's generated tokens of

    log pi(y_t | x, y<t) - log pi_T(y_t | x_T, y<t)

where pi_T is the teacher of the row's (domain, effort) cell and x_T the prompt as the
teacher reads it (`views.PromptView.teacher`: without the effort in K3's form). Its mean over
rows is a Monte Carlo estimate of the per-token reverse KL along the policy's own answers:
what MOPD's loss drives down on the training prompts, measured here on the test split.

The teacher's log-probs come from any scorer of stratified batches ([K, b, T] tokens and
mask in, [K, b, T] log-probs out): the bank in this process (`placement.TeacherScorer`) or
the teacher servers (`teacher_client.EndpointScorer`), at the scoring temperature the run's
MOPD stage uses.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import models
from mopd_jax.models import logprobs
from mopd_jax.rollout import turns as rollout
from mopd_jax.training import mopd, vocab_kl


@functools.partial(jax.jit, static_argnames=("model_cfg",))
def _policy_logprobs(model_cfg: models.ModelConfig, params, tokens_BxT, *, input_mask_BxT):
  return logprobs.token_logprobs(model_cfg, params, tokens_BxT, input_mask=input_mask_BxT)


@dataclasses.dataclass(frozen=True)
class Scoring:
  """Where a batch's rows are scored: by teacher `cell` of the `scorer`'s `num_cells`, each
  response after its prompt with the effort `shown` (None: none). `rows` > a batch's size
  pads it with empty rows to that many, so that every batch of an eval has one shape."""
  scorer: Callable
  cell: int
  num_cells: int
  shown: Optional[str]
  rows: int = 0
  width_multiple: int = 32


def row_logratios(model_cfg: models.ModelConfig, params, tok, *,
                  trajs: Sequence[rollout.Trajectory], examples: Sequence,
                  scoring: Scoring) -> np.ndarray:
  """[len(trajs)] each response's mean per-token log pi - log pi_T over its generated
  tokens (0 for an empty one): pi = (model_cfg, params), the teacher as `scoring` says."""
  n, mult = len(trajs), scoring.width_multiple
  b = max(scoring.rows, n)
  empty = rollout.empty_rows(trajs[0], b - n)
  arr = rollout.pad_batch(list(trajs) + empty, tok.pad_id, rollout.padded_width(
      max(len(t.prompt_ids) + t.num_tokens for t in trajs), mult))
  lp_pi = np.asarray(_policy_logprobs(model_cfg, params, jnp.asarray(arr["tokens"]),
                                      input_mask_BxT=jnp.asarray(arr["input_mask"])))[:n]
  t_arr, spans = mopd.teacher_view(tok, trajs, examples, width_multiple=mult,
                                   shown=[scoring.shown] * n)
  width, k = t_arr["tokens"].shape[1], scoring.cell
  tokens = np.zeros((scoring.num_cells, b, width), np.int32)
  mask = np.zeros((scoring.num_cells, b, width), bool)
  tokens[k, :n], mask[k, :n] = t_arr["tokens"], t_arr["input_mask"]
  scores = scoring.scorer(tokens, mask)
  if isinstance(scores, tuple):  # a top-k scorer: (log-probs, top-k log-probs, ids)
    scores = scores[0]
  lp_t = mopd.realign(np.asarray(scores)[k, :n], spans, arr["tokens"].shape[1])
  loss = np.asarray(arr["loss_mask"], bool)[:n]
  return np.where(loss, lp_pi - lp_t, 0.0).sum(1) / np.maximum(loss.sum(1), 1)


def logratio_table(cells: Sequence[dict], grid_cells) -> list:
  """report.md's lines of pi_SFT's and the student's held-out log-ratio to each cell's
  teacher (`eval.teacher_logratio`) over the grid's (domain, effort) `grid_cells`; none when
  the eval did not measure it."""
  have = {(c["policy"], c["domain"], c["effort"]): c for c in cells if "teacher_logratio" in c}
  if not have:
    return []
  lines = ["", "Mean per-token log pi - log pi_teacher along each policy's greedy test answers "
           "(a reverse-KL estimate on held-out prompts; ± its standard error over the answers):",
           "", "| domain | effort | sft | student |", "|---|---|---|---|"]
  for d, e in grid_cells:
    row = [d, e]
    for p in ("sft", "student"):
      c = have.get((p, d, e))
      row.append("-" if c is None else
                 f"{c['teacher_logratio']:.4f} ± {c['teacher_logratio_se']:.4f}")
    lines.append("| " + " | ".join(row) + " |")
  return lines


HELDOUT_KEY = 13  # the eval's held-out rollout key (`stages.eval.heldout_kl`)
# What `heldout_kl` measured, in words.
MEASURES = {"exact": "exact per-token KL",
            "sampled": "sampled sequence log-ratio per token (teachers of another tokenizer)"}


def logratio_rows(scoring, sampled) -> np.ndarray:
  """[B, T] each generated token's share of its rollout's log pi(y) - log pi_T(y) for
  teachers of another tokenizer (no shared vocabulary, so no exact KL): the teacher scores
  the response in its own tokens and each aligned span's log-ratio, unclipped, is spread
  over the span's tokens (`alignment.cross_teacher_logprobs`), so a row sums to the
  rollout's sequence log-ratio, whose mean over pi's own rollouts estimates the sequence
  KL(pi || pi_T) without bias (pi_T(y): the probability of the teacher's own tokenization of
  y). 0 off the generated tokens and on a row the teacher could not take."""
  # pylint: disable-next=g-import-not-at-top
  from mopd_jax.teachers import alignment, bank as teachers, families
  arr, n = sampled.arr, sampled.arr["tokens"].shape[0]
  scored = teachers.scatter_stratified(  # a MixedBank: each family's teachers by its bank
      np.asarray(families.score_stratified(scoring, sampled.tokens, sampled.input_mask)),
      sampled.index, n)
  lp_t = alignment.cross_teacher_logprobs(arr, scored, spans=sampled.spans,
                                          alignments=sampled.alignments, r_max=np.inf,
                                          assign="spread")
  return np.where(measured_mask(sampled), np.asarray(arr["sampler_logprobs"], np.float32) - lp_t,
                  0.0)


def measured_mask(sampled) -> np.ndarray:
  """[B, T] the generated tokens a held-out measure reads: all of them, less the rows a
  teacher of another tokenizer could not take (`sampled.alignments` None there)."""
  mask = np.asarray(sampled.arr["loss_mask"], bool).copy()
  if sampled.alignments is not None:
    mask[[i for i, a in enumerate(sampled.alignments) if a is None]] = False
  return mask


def heldout_batches(model_cfg: models.ModelConfig, params, setup: "mopd.StepSetup", *, scoring,
                    examples: Mapping[str, Sequence], rng, batch: int = 32):
  """Yields (sampled, [B, T] per-token rows) of pi's rollouts after `examples[d]` at every
  effort of `setup.cells`, `batch` prompts per cell per call, the i-th call keyed by
  fold_in(rng, i): the batches `heldout_kl` measures (and `experiments/kl_tail.py` ranks).
  The rows are the exact KL over the whole vocabulary, or, with teachers of another
  tokenizer (`setup.teacher_tok`), the sampled log-ratio (`logratio_rows`)."""
  n = min(len(examples[d]) for d, _ in setup.cells)
  for i, start in enumerate(range(0, n, batch)):
    per_cell = [list(examples[d][start:start + batch]) for d, _ in setup.cells]
    sampled = mopd.sample_batch(setup, params, per_cell, rng=jax.random.fold_in(rng, i))
    if setup.teacher_tok is not None:
      yield sampled, logratio_rows(scoring, sampled)
    else:
      yield sampled, vocab_kl.exact_kl_rows(model_cfg, params, scoring, sampled=sampled)


def heldout_kl(model_cfg: models.ModelConfig, params, setup: "mopd.StepSetup", *, scoring,
               examples: Mapping[str, Sequence], rng, batch: int = 32) -> dict:
  """The exact per-token KL(pi || routed teacher) over the whole vocabulary along pi's own
  rollouts, the MOPD stage's measure (`vocab_kl.exact_kl_rows`) on held-out prompts: pi =
  (model_cfg, params) samples once (`setup.engine`) after each of `examples[d]` at every
  effort of `setup.cells`, `batch` prompts per cell per call; `scoring` is the bank at its
  scoring temperature.

  Returns {"kl_exact", "kl_exact_se", "rollouts", "tokens", "measure", "cells": {"d/e":
  {"kl_exact", "kl_exact_se", "rollouts"}}}: each the mean over the generated tokens, with
  the standard error of that ratio of sums over independent rollouts (a rare rollout that
  leaves its teacher's style carries a large KL over its tokens, so the error is reported
  with it). `measure`: "exact", or with teachers of another tokenizer "sampled" (the
  sequence log-ratio per token, `logratio_rows`; rows the teacher could not take left out).
  """
  sums, counts, cell_ids = [], [], []
  cross = setup.teacher_tok is not None
  for sampled, kl in heldout_batches(model_cfg, params, setup, scoring=scoring,
                                     examples=examples, rng=rng, batch=batch):
    rows = len(sampled.lengths)
    mask = measured_mask(sampled)[:rows]
    sums.append((kl[:rows] * mask).sum(1))
    counts.append(mask.sum(1))
    cell_ids.append(np.asarray(sampled.cell_ids)[:rows])
  sums, counts, cell_ids = map(np.concatenate, (sums, counts, cell_ids))
  keep = counts > 0 if cross else np.ones(len(sums), bool)
  sums, counts, cell_ids = sums[keep], counts[keep], cell_ids[keep]
  out = {**_token_mean(sums, counts), "rollouts": len(sums), "tokens": int(counts.sum()),
         "measure": "sampled" if cross else "exact",
         "tail": rollout_tail(sums, counts), "cells": {}}
  for j, (d, e) in enumerate(setup.cells):
    sel = cell_ids == j
    out["cells"][f"{d}/{e}"] = {**_token_mean(sums[sel], counts[sel]),
                                "rollouts": int(sel.sum())}
  return out


def heldout_drop(held: dict, before: str = "sft", after: str = "student") -> Optional[tuple]:
  """(ratio, its standard error) of policy `before`'s exact KL over policy `after`'s in
  `held` ({policy: `heldout_kl`}, the eval's `kl_heldout`: "sft" pi_SFT, "init" the
  initialised student, "student" the final one; the error propagated from theirs), or None
  without both or with `after`'s at 0."""
  if before not in held or after not in held or held[after]["kl_exact"] <= 0:
    return None
  a, b = held[before], held[after]
  ratio = a["kl_exact"] / b["kl_exact"]
  return ratio, ratio * float(np.hypot(a["kl_exact_se"] / max(a["kl_exact"], 1e-12),
                                       b["kl_exact_se"] / b["kl_exact"]))


def on_policy_start(held: dict) -> Optional[str]:
  """The policy the MOPD steps start from in `held`: the initialised student ("init") when
  the run has a teacher-SFT init, else pi_SFT ("sft"); None without either."""
  return "init" if "init" in held else "sft" if "sft" in held else None


def rising_cells(held: dict, before: str, after: str = "student", *, z: float = 2.0) -> list:
  """The cells whose held-out KL rises from policy `before` to `after` by more than `z`
  standard errors of the difference (each cell's errors, independent rollouts, combined in
  quadrature), in grid order; [] when every cell stays within that."""
  cb, ca = held[before]["cells"], held[after]["cells"]
  return [name for name in cb if name in ca and
          ca[name]["kl_exact"] - cb[name]["kl_exact"] >
          z * float(np.hypot(ca[name]["kl_exact_se"], cb[name]["kl_exact_se"]))]


def heldout_lines(held: dict) -> list:
  """report.md's paragraph and per-cell table of the held-out KL (`eval.kl_rollouts`; its
  `measure`):
  pi_SFT, the initialised student and the final student, with standard errors and the two
  drops the expected results divide."""
  names = {"sft": "pi_SFT", "init": "the initialised student", "student": "the final student"}
  have = [p for p in names if p in held]
  if len(have) < 2:
    return []
  first = held[have[0]]
  measure = MEASURES[first.get("measure", "exact")]
  lines = ["", f"{measure[0].upper() + measure[1:]} to the routed teachers on held-out "
           f"prompts, each policy's own rollouts of {first['rollouts']} test prompts "
           f"(± standard error): " + ", ".join(
               f"{names[p]} {held[p]['kl_exact']:.4f} ± {held[p]['kl_exact_se']:.4f}"
               for p in have) + "."]
  pairs = [("sft", "init", "the init's drop"),
           (on_policy_start(held), "student", "the on-policy drop")]
  if "init" in held:
    pairs.append(("sft", "student", "the whole distillation's drop"))
  for a, b, what in pairs:
    r = heldout_drop(held, a, b)
    if r is not None:
      lines.append(f"- {what}: {names[a]} / {names[b]} = x{r[0]:.2f} ± {r[1]:.2f}")
  tails = [p for p in have if held[p].get("tail")]
  if tails:
    lines += ["", f"Per-rollout {measure} (each rollout's mean over its tokens): quantiles, "
              "and the share of the summed KL carried by the top 1% / 5% of rollouts:", "",
              "| policy | p50 | p90 | p99 | max | top 1% | top 5% |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {names[p]} | " + " | ".join(f"{held[p]['tail'][k]:.4f}" for k in (
        "p50", "p90", "p99", "max")) + f" | {held[p]['tail']['top1pct_share']:.2f} | "
              f"{held[p]['tail']['top5pct_share']:.2f} |" for p in tails]
  lines += ["", "| cell | " + " | ".join(names[p] for p in have) + " |",
            "|---|" + "---|" * len(have)]
  for cell in first["cells"]:
    lines.append(f"| {cell} | " + " | ".join(
        f"{held[p]['cells'][cell]['kl_exact']:.4f} ± {held[p]['cells'][cell]['kl_exact_se']:.4f}"
        for p in have) + " |")
  return lines


def rollout_tail(sums: np.ndarray, counts: np.ndarray) -> dict:
  """The per-rollout distribution behind a token-mean KL: quantiles of each rollout's mean
  KL over its tokens, and the share of the summed KL that its top 1% and 5% of rollouts (by
  summed KL) carry; a mean made by a few rollouts that left the track shows here."""
  if not len(sums) or counts.sum() == 0:
    return {}
  per = sums / np.maximum(counts, 1)
  top = np.sort(sums)[::-1]
  share = lambda f: float(top[:max(1, int(round(f * len(top))))].sum() / max(top.sum(), 1e-30))
  return {"p50": float(np.quantile(per, 0.5)), "p90": float(np.quantile(per, 0.9)),
          "p99": float(np.quantile(per, 0.99)), "max": float(per.max()),
          "top1pct_share": share(0.01), "top5pct_share": share(0.05)}


def kl_onsets(rows_by_cell: dict, *, threshold: float, top: int = 3) -> dict:
  """Where each cell's held-out KL enters. `rows_by_cell`: {cell: [each rollout's per-token
  KL over its generated tokens]}. Per cell, the `top` response positions (token indices),
  among those at least half its rows reach, whose KL averaged over the rows reaching them is
  largest; for each, that mean, the rows whose KL there exceeds `threshold`, and their share
  of the cell's summed KL and of every cell's. A position every rollout passes (the `agt`
  call's first argument letter) whose rare errors lead off the track shows as a small mean
  with a large share."""
  total = sum(sum(k) for rows in rows_by_cell.values() for k in rows) or 1.0
  out = {}
  for cell in sorted(rows_by_cell):
    mine = rows_by_cell[cell]
    width = max(len(k) for k in mine)
    sums, counts = np.zeros(width), np.zeros(width)
    for k in mine:
      sums[:len(k)] += k
      counts[:len(k)] += 1
    # Positions at least half the cell's rows reach: the track, not one long rollout's end.
    means = np.where(counts * 2 >= len(mine), sums / np.maximum(counts, 1), -1.0)
    cell_sum = sum(sum(k) for k in mine) or 1.0
    out[cell] = []
    for pos in np.argsort(-means, kind="stable")[:top]:
      hit = [k for k in mine if len(k) > pos and k[pos] > threshold]
      hit_sum = sum(sum(k) for k in hit)
      out[cell].append({"position": int(pos), "mean_kl": float(means[pos]), "rows": len(mine),
                        "rows_above": len(hit), "share_of_cell": hit_sum / cell_sum,
                        "share_of_all": hit_sum / total})
  return out


def _token_mean(sums: np.ndarray, counts: np.ndarray) -> dict:
  """The token mean sum(sums) / sum(counts) over rollouts and its standard error (the
  linearised ratio estimator's, over the rollouts)."""
  total = counts.sum()
  if total == 0:
    return {"kl_exact": 0.0, "kl_exact_se": 0.0}
  mean = sums.sum() / total
  r = len(sums)
  resid = sums - mean * counts
  se = np.sqrt(r / max(r - 1, 1) * np.sum(resid ** 2)) / total
  return {"kl_exact": float(mean), "kl_exact_se": float(se)}
