"""MOPD diagnostics measured on a few steps, off the update's path, on the params the step's
update starts from (`Probe.measure`, which `mopd.train_on` calls before the update):

* effort sensitivity (`effort_kl_rows`, `effort_sensitivity`): along the student's own
  rollouts, the exact per-token KL(pi(.|e_a, x, y<t) || pi(.|e_b, x, y<t)) between
  neighbouring efforts (e_a, e_b) of the grid's order, the prompt re-rendered with each
  effort and the response kept: how much the effort in the prompt still moves the student's
  next-token distribution on the same text. Each effort's prompt may have its own length
  (a system line, a chat template): the KL compares the predictions of each response token,
  wherever each rendering puts it.
* loss shares (`loss_shares`): each cell's share of the loss's generated tokens, of its
  per-sequence weight, and of the gradient norm, under the loss's own normalisation (1/|y|
  per row, then a mean over the rows: every sequence weighs the same) and under a token mean
  (every token weighs the same). A cell's gradient is the gradient of the batch loss with
  every other row's weight set to 0 and the whole batch's normalisation kept, so the cells'
  gradients sum to the batch's.

Keys they add to a step's record: `EFFORT_KL_PREFIX` + `pair_key(a, b)` (overall and per
cell), `SHARE_KEYS` per cell, `GRAD_NORM_KEYS` overall and per cell.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mopd_jax import models
from mopd_jax.models import logprobs
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import distributed
from mopd_jax.tasks.grid import Grid
from mopd_jax.training import registry as loss_kinds, step as train

EFFORT_KL_PREFIX = "effort_kl/"
# Per cell: its share of the batch's generated tokens (= its loss weight under a token mean),
# of the rows holding them (its loss weight under the per-sequence normalisation), and of
# the cells' summed gradient norms under each normalisation.
SHARE_KEYS = ("token_share", "seq_weight_share", "grad_share_seq", "grad_share_tok")
# The gradient norm of a cell's rows (per cell) or of the whole batch (overall), under the
# per-sequence normalisation and under a token mean.
GRAD_NORM_KEYS = ("grad_norm_seq", "grad_norm_tok")


def neighbour_pairs(efforts: Sequence[str]) -> list:
  """[(e_0, e_1), (e_1, e_2), ...]: each effort with the next one of `efforts`' order."""
  efforts = tuple(efforts)
  return list(zip(efforts[:-1], efforts[1:]))


def pair_key(a: str, b: str) -> str:
  """The record key of KL(pi(.|a) || pi(.|b)): "effort_kl/a-b". Effort names hold only
  letters, digits and _, so "-" separates them unambiguously and stays a valid TensorBoard
  tag."""
  return f"{EFFORT_KL_PREFIX}{a}-{b}"


def student_responses(tok, sampled, cells: Sequence[tuple]) -> list:
  """Per real row of `sampled` (a `mopd.SampledBatch` holding its examples): (example,
  response ids, generated-token mask) of the student's rollout, read off the student's
  layout after the prompt of the row's own effort (checked against the batch's tokens)."""
  if sampled.examples is None:
    raise ValueError("the effort sensitivity re-renders each rollout's prompt: the batch "
                     "must hold its examples (SampledBatch.examples)")
  tokens, loss_mask = np.asarray(sampled.arr["tokens"]), np.asarray(sampled.arr["loss_mask"])
  out = []
  for i, (ex, cell, n) in enumerate(zip(sampled.examples, sampled.cell_ids, sampled.lengths)):
    prompt = rollout.encode_prompt(tok, ex, cells[cell][1])
    p, n = len(prompt), int(n)
    if tokens[i, :p].tolist() != prompt:
      raise ValueError(f"row {i}: the batch's prompt is not its example's prompt at effort "
                       f"{cells[cell][1]!r}")
    out.append((ex, tokens[i, p:p + n], loss_mask[i, p:p + n]))
  return out


def effort_views(tok, responses: Sequence[tuple], efforts: Sequence[str], *,
                 width_multiple: int = 32) -> tuple:
  """The same responses after each effort's prompt: (tokens [E, B, T], input mask
  [E, B, T], response start [E, B], generated-token mask [B, R] on a response-aligned
  layout: response token j in column j). T and R are padded to `width_multiple`, so that
  steps of similar lengths share a compilation."""
  prompts = [[rollout.encode_prompt(tok, ex, e) for ex, _, _ in responses] for e in efforts]
  longest = max(len(p) + len(ids) for row in prompts for p, (_, ids, _) in zip(row, responses))
  e_n, b = len(efforts), len(responses)
  t = rollout.padded_width(longest, width_multiple)
  r = rollout.padded_width(max(len(ids) for _, ids, _ in responses), width_multiple)
  tokens = np.full((e_n, b, t), tok.pad_id, np.int32)
  mask = np.zeros((e_n, b, t), bool)
  starts = np.zeros((e_n, b), np.int32)
  gen = np.zeros((b, r), bool)
  for i, (_, ids, g) in enumerate(responses):
    gen[i, :len(g)] = g
    for j in range(e_n):
      seq = list(prompts[j][i]) + list(ids)
      tokens[j, i, :len(seq)], mask[j, i, :len(seq)] = seq, True
      starts[j, i] = len(prompts[j][i])
  return tokens, mask, starts, gen


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("chunk_size",))
def _effort_kl(cfg, params, tokens_ExBxT, *, input_mask, starts, response_mask, chunk_size):
  """[E-1, B, R] exact KL(pi(.|e) || pi(.|e+1)) of each response token's prediction, 0 off
  `response_mask`. Each rendering's hidden states are gathered onto the response-aligned
  layout (the state predicting response token j sits at start + j - 1), so the renderings'
  prompts may differ in length; the head runs in chunks (`logprobs.kl_from_hidden`)."""
  cfg, params = models.materialize(cfg, params)
  h = jax.vmap(lambda t, m: models.hidden_states(cfg, params, t, input_mask=m))(
      tokens_ExBxT, input_mask)  # [E, B, T, D]
  r = response_mask.shape[1]
  # R + 1 columns: `kl_from_hidden` compares column c - 1's predictions in its column c.
  pos = starts[..., None] - 1 + jnp.arange(r + 1)[None, None, :]
  g = jnp.take_along_axis(h, jnp.clip(pos, 0, h.shape[2] - 1)[..., None], axis=2)
  kl = jax.vmap(lambda a, b: logprobs.kl_from_hidden(cfg, params, a, cfg_q=cfg, params_q=params,
                                                     hidden_q_BxTxD=b,
                                                     chunk_size=chunk_size))(g[:-1], g[1:])
  return jnp.where(response_mask[None], kl[..., 1:], 0.0)


def _replicated(params, tree):
  """`tree` as global arrays replicated over the params' mesh in a multi-process run (every
  process holds the whole batch); unchanged in a single process."""
  if jax.process_count() == 1:
    return tree
  rep = jax.sharding.NamedSharding(distributed.mesh_of(params), jax.sharding.PartitionSpec())
  return distributed.to_global(tree, rep)


def effort_kl_rows(cfg: models.ModelConfig, params, sampled, *, tok, cells: Sequence[tuple],
                   efforts: Sequence[str], chunk_size: int = 64) -> tuple:
  """(KL [P, B, R], generated-token mask [B, R]): for each of the P = |efforts| - 1
  neighbouring pairs (`neighbour_pairs`), the exact per-token KL(pi(.|e_a) || pi(.|e_b)) of
  the student (`params`) along each real row's response of `sampled`, on the
  response-aligned layout (`effort_views`), 0 off the generated tokens. `cells`: the
  (domain, effort) of each cell id, to find each row's own prompt."""
  host = effort_views(tok, student_responses(tok, sampled, cells), efforts)
  tokens, mask, starts, gen = _replicated(params, host)
  kl = _effort_kl(cfg, params, tokens, input_mask=mask, starts=starts, response_mask=gen,
                  chunk_size=chunk_size)
  return np.asarray(distributed.gather(kl)), host[3]


def _token_means(values_PxBxR, mask_BxR, rows_of_cell: dict, *, keys: Sequence[str]) -> tuple:
  """(overall, per cell) token means of each of P per-token arrays under the mask."""
  def means(rows):
    m = mask_BxR[rows]
    return {k: float(v[rows][m].mean()) if m.any() else 0.0
            for k, v in zip(keys, values_PxBxR)}
  return means(slice(None)), {name: means(rows) for name, rows in rows_of_cell.items()}


def effort_sensitivity(cfg: models.ModelConfig, params, sampled, *, tok,
                       cells: Sequence[tuple], efforts: Sequence[str],
                       chunk_size: int = 64) -> tuple:
  """(overall, per cell) mean of `effort_kl_rows` over the generated tokens, keyed by
  `pair_key`; ({}, {}) with fewer than two efforts."""
  pairs = neighbour_pairs(efforts)
  if not pairs or not len(sampled.lengths):
    return {}, {}
  kl, gen = effort_kl_rows(cfg, params, sampled, tok=tok, cells=cells, efforts=efforts,
                           chunk_size=chunk_size)
  return _token_means(kl, gen, rows_of_cells(sampled, cells),
                      keys=[pair_key(*p) for p in pairs])


def rows_of_cells(sampled, cells: Sequence[tuple]) -> dict:
  """{"domain/effort": its real rows of `sampled`}, the cells holding rows, in cell order."""
  ids = np.asarray(sampled.cell_ids)
  return {f"{d}/{e}": np.flatnonzero(ids == k) for k, (d, e) in enumerate(cells)
          if (ids == k).any()}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _cell_grad_norms(model_cfg, loss_cfg, params, *, batch, rows_Kxb, scale_Kxbx2):
  """([K, 2] gradient norms of each cell under both normalisations, [2] of the whole
  batch's): cell k is the loss on its own rows `rows_Kxb[k]` (-1: none), with its rows'
  parts scaled by `scale_Kxbx2[k, :, j]` for normalisation j.

  The loss is row-normalised (`losses.row_normalised_mean`): a mean over the rows holding
  tokens of a term that depends on that row's token stats alone, and rows never interact in
  the model. So the loss on a cell's rows, its cotangent on their token stats scaled row by
  row, gives that cell's part of the whole batch's gradient at the cost of its own rows: in
  all, one forward and two backward passes of the batch (a `lax.scan` over the cells, which
  also sums their gradients into the whole batch's)."""
  ids = batch.teacher_topk_ids if loss_kinds.LOSS_KINDS[loss_cfg.kind].topk else None

  def cell(acc, xs):
    rows, scale = xs
    sub = jax.tree.map(lambda x: x[jnp.maximum(rows, 0)], batch)
    sub = sub.replace(loss_mask=sub.loss_mask & (rows >= 0)[:, None])
    sub_ids = None if ids is None else sub.teacher_topk_ids

    def stats(p):
      cfg, p = models.materialize(model_cfg, p)
      st = logprobs.token_stats(cfg, p, sub.tokens, input_mask=sub.input_mask,
                                chunk_size=loss_cfg.chunk_size,
                                top_k=0 if ids is None else ids.shape[-1],
                                topk_ids_BxTxK=sub_ids)
      return (st.logprobs,) if ids is None else (st.logprobs, st.topk_logprobs)

    def loss(s):
      st = (logprobs.TokenStats(s[0]) if ids is None else
            logprobs.TokenStats(s[0], None, s[1], sub_ids))
      return loss_kinds.loss_from_stats(loss_cfg, st, sub)[0]

    s, pullback = jax.vjp(stats, params)
    ct = jax.grad(loss)(s)
    grads = [pullback(tuple(c * scale[:, j].reshape((-1,) + (1,) * (c.ndim - 1)).astype(c.dtype)
                            for c in ct))[0] for j in range(2)]
    acc = [jax.tree.map(lambda a, g: a + g.astype(jnp.float32), a, g)
           for a, g in zip(acc, grads)]
    return acc, jnp.stack([optax.tree.norm(g) for g in grads])

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  acc, norms = jax.lax.scan(cell, [zeros, zeros], (rows_Kxb, scale_Kxbx2))
  return norms, jnp.stack([optax.tree.norm(a) for a in acc])


def loss_shares(model_cfg: models.ModelConfig, loss_cfg: train.LossConfig, params, *,
                batch: train.TrainBatch, rows_of_cell: dict) -> tuple:
  """(overall, per cell) shares of the batch's loss (`SHARE_KEYS`, `GRAD_NORM_KEYS`).

  Weight of row i (n_i generated tokens; N rows holding tokens, M tokens in all) under the
  per-sequence normalisation: 1 / N for its token mean; under a token mean: n_i / M. A
  cell's gradient: the loss with every other row's weight 0 and the whole batch's N or M
  kept, so the cells' gradients sum to the batch's; `grad_share_*` is a cell's norm over
  the sum of the cells' norms (the shares sum to 1; the sum is at least the batch's norm,
  `grad_norm_*` overall, with equality when the cells' gradients point the same way). The
  loss on a cell's N_k rows is normalised by N_k: its row parts are rescaled by N_k / N,
  or by N_k n_i / M for the token mean. Memory: one cell's activations at a time and two
  float32 gradient sums (the whole batch's under each normalisation)."""
  kind = loss_kinds.LOSS_KINDS[loss_cfg.kind]
  if kind.weighting != "rows" or kind.groups:
    raise ValueError(f"loss shares need a row-normalised loss; {loss_cfg.kind!r} weighs "
                     f"{'groups' if kind.groups else kind.weighting}")
  if not rows_of_cell:
    return {}, {}
  n_tok = np.asarray(batch.loss_mask, bool).sum(-1).astype(np.float64)  # [B]
  m_tok, n_rows = n_tok.sum(), float((n_tok > 0).sum())
  names = list(rows_of_cell)
  b = max(len(r) for r in rows_of_cell.values())
  rows = np.full((len(names), b), -1, np.int32)
  scale = np.zeros((len(names), b, 2), np.float32)
  for k, name in enumerate(names):
    r = np.asarray(rows_of_cell[name])
    n_k = float((n_tok[r] > 0).sum())
    rows[k, :len(r)] = r
    scale[k, :len(r), 0] = n_k / max(n_rows, 1.0)
    scale[k, :len(r), 1] = n_k * n_tok[r] / max(m_tok, 1.0)
  norms, full = distributed.gather(_cell_grad_norms(
      model_cfg, loss_cfg, params, batch=_replicated(params, batch),
      rows_Kxb=_replicated(params, rows), scale_Kxbx2=_replicated(params, scale)))
  norms, full = np.asarray(norms, np.float64), np.asarray(full, np.float64)
  share = lambda x, total: float(x / total) if total > 0 else 0.0
  cells = {}
  for k, name in enumerate(names):
    r = rows_of_cell[name]
    seq, tok = norms[k]
    cells[name] = {"token_share": share(n_tok[r].sum(), m_tok),
                   "seq_weight_share": share((n_tok[r] > 0).sum(), n_rows),
                   "grad_share_seq": share(seq, norms[:, 0].sum()),
                   "grad_share_tok": share(tok, norms[:, 1].sum()),
                   "grad_norm_seq": float(seq), "grad_norm_tok": float(tok)}
  return {"grad_norm_seq": float(full[0]), "grad_norm_tok": float(full[1])}, cells


def exact_kl_means(kl_rows_BxT, sampled, names: Sequence[str]) -> tuple:
  """(overall, per cell) `kl_exact`: the mean of `vocab_kl.exact_kl_rows` over the batch's
  generated tokens, and over each routed teacher's (`names`, the bank's order) rows'."""
  mask = np.asarray(sampled.arr["loss_mask"], bool)
  index = sampled.index
  cells = {}
  for k, name in enumerate(names):
    rows = index[k][index[k] >= 0]
    if len(rows):
      sel = mask[rows]
      cells[name] = {"kl_exact": float(kl_rows_BxT[rows][sel].mean()) if sel.any() else 0.0}
  return {"kl_exact": float(kl_rows_BxT[mask].mean()) if mask.any() else 0.0}, cells


def merge(*measured: tuple) -> tuple:
  """Several (metrics, per-cell metrics) pairs as one."""
  metrics, cells = {}, {}
  for m, c in measured:
    metrics.update(m)
    for name, cm in c.items():
      cells[name] = {**cells.get(name, {}), **cm}
  return metrics, cells


@dataclasses.dataclass(frozen=True)
class Probe:
  """The diagnostics of a measured MOPD step, bound to the run's student, loss and grid:
  `measure(params, sampled, batch)` has the form of `mopd.train_on`'s hook."""

  model_cfg: models.ModelConfig
  loss_cfg: train.LossConfig
  tok: object
  cells: tuple  # (domain, effort) of each cell id of the batch (`SampledBatch.cell_ids`)
  efforts: tuple  # the grid's effort order: its neighbours are the compared pairs
  chunk_size: int = 64

  def measure(self, params, sampled, batch: train.TrainBatch) -> tuple:
    """(metrics, per-cell metrics) of the step: effort sensitivity and loss shares (for the
    losses of the student's token stats), both on `params` (the student the update starts
    from)."""
    sensitivity = effort_sensitivity(self.model_cfg, params, sampled, tok=self.tok,
                                     cells=self.cells, efforts=self.efforts,
                                     chunk_size=self.chunk_size)
    if loss_kinds.LOSS_KINDS[self.loss_cfg.kind].teachers_in_step:
      return sensitivity  # the shares split a loss of the student's token stats by rows
    return merge(sensitivity, loss_shares(self.model_cfg, self.loss_cfg, params, batch=batch,
                                          rows_of_cell=rows_of_cells(sampled, self.cells)))


# ----------------------------------------------------------------------------- report
def report_entries(history: Sequence[dict]) -> dict:
  """report.json's entries of these diagnostics, from mopd/history.json: `effort_kl` and
  `loss_shares`, each {"curve": {key: [[step, value], ...]}, "per_cell": {cell: {key:
  [[step, value], ...]}}} over the steps that measured them."""
  effort = list(dict.fromkeys(k for h in history for k in h if k.startswith(EFFORT_KL_PREFIX)))
  return {"effort_kl": _curves(history, effort),
          "loss_shares": _curves(history, SHARE_KEYS + GRAD_NORM_KEYS)}


def _curves(history, keys) -> dict:
  def pick(records):
    out = {k: [[s, r[k]] for s, r in records if k in r] for k in keys}
    return {k: v for k, v in out.items() if v}
  names = dict.fromkeys(n for h in history for n in h["cells"])
  per_cell = {n: pick([(h["step"], h["cells"][n]) for h in history if n in h["cells"]])
              for n in names}
  return {"curve": pick([(h["step"], h) for h in history]),
          "per_cell": {n: c for n, c in per_cell.items() if c}}


def _ends(curve, fmt: str = ".4f") -> str:
  """"first -> last" values of a [[step, value], ...] curve; "-" without one."""
  return "-" if not curve else f"{curve[0][1]:{fmt}} → {curve[-1][1]:{fmt}}"


def _cells_over_batch(shares: dict, key: str) -> list:
  """[[step, sum of the cells' `key` norms / the whole batch's]] of each measured step."""
  sums = {}
  for c in shares["per_cell"].values():
    for s, v in c.get(key, []):
      sums[s] = sums.get(s, 0.0) + v
  return [[s, sums[s] / v] for s, v in shares["curve"].get(key, []) if v > 0 and s in sums]


def report_lines(rep: dict) -> list:
  """report.md's paragraphs and tables of these diagnostics: each value at the first
  measured step and at the last; cells and effort pairs in the grid's order."""
  lines = []
  grid = Grid.from_json(rep["grid"])
  in_order = lambda per_cell: [(n, per_cell[n]) for n in grid.names if n in per_cell]
  effort = rep.get("effort_kl") or {}
  pairs = [k for k in (pair_key(*p) for p in neighbour_pairs(grid.effort_names))
           if k in effort.get("curve", {})]
  if pairs:
    label = lambda k: "KL(" + " ‖ ".join(k[len(EFFORT_KL_PREFIX):].split("-")) + ")"
    steps = effort["curve"][pairs[0]]
    lines += ["", "Effort sensitivity of the student: the mean per-token KL(pi(.|e_a, x, y<t) "
              "‖ pi(.|e_b, x, y<t)) over the generated tokens of its own rollouts, the prompt "
              "rendered with each of two neighbouring efforts; first measured step → last "
              f"(steps {steps[0][0]} → {steps[-1][0]}): " + ", ".join(
                  f"{label(k)} {_ends(effort['curve'][k])}" for k in pairs) + ".", "",
              "| cell | " + " | ".join(label(k) for k in pairs) + " |",
              "|---|" + "---|" * len(pairs)]
    lines += [f"| {name} | " + " | ".join(_ends(c.get(k)) for k in pairs) + " |"
              for name, c in in_order(effort["per_cell"])]
  shares = rep.get("loss_shares") or {}
  if shares.get("per_cell"):
    full = shares["curve"]
    lines += ["", "Each cell's share of the loss, first measured step → last: of the generated "
              "tokens (its weight under a token mean), of the rows (its weight under the "
              "per-sequence 1/|y| normalisation the loss uses), and of the gradient norm under "
              "each normalisation: the norm of the gradient of the batch loss restricted to "
              "the cell's rows (the batch's normalisation kept) over the sum of the cells' "
              "norms. Whole-batch gradient norm, per sequence "
              f"{_ends(full.get('grad_norm_seq'))}, token mean "
              f"{_ends(full.get('grad_norm_tok'))}; the cells' norms sum to "
              f"{_ends(_cells_over_batch(shares, 'grad_norm_seq'), '.2f')} and "
              f"{_ends(_cells_over_batch(shares, 'grad_norm_tok'), '.2f')} times it (1 when "
              "the cells' gradients point the same way).", "",
              "| cell | token share | per-sequence weight share | gradient share, per sequence "
              "| gradient share, token mean |", "|---|---|---|---|---|"]
    lines += [f"| {name} | " + " | ".join(_ends(c.get(k), ".3f") for k in SHARE_KEYS) + " |"
              for name, c in in_order(shares["per_cell"])]
  return lines
