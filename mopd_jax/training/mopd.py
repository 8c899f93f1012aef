"""Multi-teacher on-policy distillation (Kimi K3 §4.1.3): one student, a frozen teacher per
(domain, effort) cell of the run's grid.

One step:
  1. draw prompts with their (domain, effort) labels: b prompts per (domain, effort) cell, so
     the batch is stratified by teacher ([K, b, T]);
  2. the student samples ONE trajectory per prompt with the effort in its context
     (multi-turn for agt); nothing is copied from a teacher;
  3. the router sends each trajectory to teacher (d, e), which prefills it in one forward
     pass (prompt and observation tokens masked) and returns one log-prob per token. The
     teacher's prompt is the same prompt with the effort `views.PromptView.teacher` gives:
     none (K3 eq. 15 conditions only the student on e), or e in the ablation, where the
     teacher scores the student's own layout; an effort-free teacher's log-probs are moved
     back onto the student's response positions (`realign`);
  4. the student is updated with the MOPD loss (K3 eq. 15) on every generated token, and the
     next step samples from the updated student.

Diagnostics per cell: per-token KL (student vs routed teacher): the sampled-token estimate
log pi_s - log pi_t (what r_t is made of; it can go negative) and, every few steps, the
exact KL over the whole vocabulary (`vocab_kl.exact_kl_rows`, chunked); mean reward r_t, clip
fraction, accuracy, mean length, over-budget rate at the cell's budget. The diagnostics
taken on a few steps only (the exact KL, effort sensitivity, loss shares) come from
`diagnostics.py` through `train_on`'s `measure` hook.

Which prompts each cell gets (`cell_prompts`): a domain's prompts shared across its efforts,
distinct per cell, or each prompt's effort drawn from `mopd.effort_mix`.

Options (the loss kind is the trainer's): `topk` distils on the routed teacher's top-k
log-probs instead of the sampled token's; `alpha` > 0 adds an outcome-reward REINFORCE term.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax.config import choices
from mopd_jax.rollout import partial, turns as rollout
from mopd_jax.runtime import distributed
from mopd_jax.tasks import base as task_base, views
from mopd_jax.teachers import alignment, bank as teachers, char_marginal
from mopd_jax.training import step as train, vocab_kl
from mopd_jax.training.registry import LOSS_KINDS


PROMPT_MODES = choices.PROMPT_MODES


def prompt_mode(mode: str, mix: Sequence[float], efforts: Sequence[str]) -> str:
  """`mopd.prompts_across_efforts`, checked together with `mopd.effort_mix`."""
  if mode not in PROMPT_MODES:
    raise ValueError(f"mopd.prompts_across_efforts={mode!r}; expected one of {PROMPT_MODES}")
  mix = tuple(mix)
  if mix and not (len(mix) == len(efforts) and
                  all(isinstance(w, (int, float)) and np.isfinite(w) and w >= 0 for w in mix)
                  and sum(mix) > 0):
    raise ValueError(f"mopd.effort_mix={mix!r}; expected {len(efforts)} finite weights >= 0 "
                     f"(efforts {tuple(efforts)}), not all 0, or () for prompts_per_cell "
                     "prompts per cell")
  if mix and mode == "shared":
    raise ValueError("mopd.effort_mix draws one effort per prompt; it needs "
                     "mopd.prompts_across_efforts='distinct' (shared poses every prompt at "
                     "every effort)")
  return mode


def cell_prompts(iters: dict, grid, per_cell: int, *, shared: bool, mix: Sequence[float] = (),
                 rng: Optional[np.random.RandomState] = None) -> list:
  """One step's prompts of every (domain, effort) cell, in `grid.cells` order (domain-major).

  `shared`: each domain's `per_cell` prompts are posed at every effort, so the cells'
  updates of a domain differ only by the effort token and whatever the student and its
  teachers make of it; else each cell gets `per_cell` prompts of its own (the domain's
  iterator then yields |efforts| x `per_cell`). `mix` (distinct only): weights of the
  efforts, in the grid's order; each prompt's effort is then drawn from them with `rng`, so a
  cell holds anywhere from 0 to |efforts| x `per_cell` prompts."""
  out = []
  n = len(grid.efforts)
  for d in grid.domains:
    exs = list(next(iters[d]))
    if mix:
      p = np.asarray(mix, np.float64) / np.sum(mix)
      drawn = rng.choice(n, size=len(exs), p=p)
      out.extend([ex for ex, e in zip(exs, drawn) if e == j] for j in range(n))
      continue
    for j in range(n):
      out.append(exs if shared else exs[j * per_cell:(j + 1) * per_cell])
  return out


@dataclasses.dataclass
class StepRecord:
  step: int
  metrics: dict  # train-step metrics (loss, kl, reward_mean, clip_frac, grad_norm)
  cells: dict  # "d/e" -> {kl, reward, clip_frac, accuracy, length, over_budget}


def cell_diagnostics(names, index_Kxb, lp_s_KxbxT, *, lp_t_KxbxT, mask_KxbxT, r_max,
                     sampled: "SampledBatch") -> dict:
  """Per-cell host-side diagnostics from one stratified batch (`sampled`'s accuracy, lengths
  and over-budget flags per row)."""
  accuracy_B, length_B, over_B = sampled.accuracy, sampled.lengths, sampled.over
  out = {}
  for k, name in enumerate(names):
    rows = index_Kxb[k] >= 0
    if not rows.any():
      continue
    m = mask_KxbxT[k][rows]
    d = (lp_s_KxbxT[k][rows] - lp_t_KxbxT[k][rows])[m]
    r = np.clip(-d, -r_max, r_max)
    flat = index_Kxb[k][rows]
    out[name] = {"kl": float(d.mean()) if d.size else 0.0,
                 "reward": float(r.mean()) if r.size else 0.0,
                 "clip_frac": float((np.abs(d) > r_max).mean()) if d.size else 0.0,
                 "accuracy": float(np.mean(accuracy_B[flat])),
                 "length": float(np.mean(length_B[flat])),
                 "over_budget": float(np.mean(over_B[flat]))}
  return out


def outcome_advantages(rewards_B, cell_ids_B) -> np.ndarray:
  """[B] outcome advantage of each student rollout: its verifier reward minus the mean reward
  of its (domain, effort) cell in this batch.

  A per-cell baseline rather than a batch-wide one: cells differ a lot in how often they are
  solved (domains differ in difficulty, low effort's short budget fails more), so a batch mean
  would give every rollout of an easy cell a positive advantage and every rollout of a hard
  cell a negative one whatever it did: zero-mean noise as large as the gap between cells.
  With one rollout per prompt (N = 1) the cell is the finest group whose rollouts share a
  baseline. A cell with a single rollout in the batch uses the batch mean instead: its own
  mean would make its advantage identically 0 (and the term a no-op at b = 1).
  """
  r = np.asarray(rewards_B, np.float32)
  ids = np.asarray(cell_ids_B)
  if r.shape != ids.shape or r.ndim != 1:
    raise ValueError(f"rewards {r.shape} and cell ids {ids.shape} must be the same [B] shape")
  base = np.full_like(r, r.mean() if r.size else 0.0)
  for c in np.unique(ids):
    rows = ids == c
    if rows.sum() > 1:
      base[rows] = r[rows].mean()
  return r - base


def train_batch(arr: dict, teacher_lp_BxT, *, topk: Optional[tuple] = None,
                alpha: float = 0.0, advantages_B=None) -> train.TrainBatch:
  """The train step's batch from a padded rollout batch (`rollout.pad_batch`) and the routed
  teachers' scores. alpha == 0 leaves `advantages` unset, so the step is exactly the plain
  MOPD one (no zero-valued REINFORCE term is even traced)."""
  adv = None
  if alpha:
    if advantages_B is None:
      raise ValueError(f"alpha={alpha} needs the per-rollout outcome advantages")
    # Every generated token of a rollout carries alpha * A; pg_loss row-normalises, so each
    # rollout's outcome term weighs the same whatever its length.
    adv = jnp.asarray(alpha * np.asarray(advantages_B, np.float32)[:, None] *
                      np.asarray(arr["loss_mask"], np.float32))
  return train.TrainBatch.from_padded(
      arr, sampler_logprobs=True, teacher_logprobs=teacher_lp_BxT, advantages=adv,
      teacher_topk_logprobs=None if topk is None else topk[0],
      teacher_topk_ids=None if topk is None else topk[1])


def realign(rows, spans, width: int) -> np.ndarray:
  """Per-token values of the teachers' layout ([B, T'] or [B, T', k]) moved onto the
  student's positions ([B, width, ...], 0 elsewhere). `spans[i]` = (student response start,
  teacher response start, response length) of row i; the response tokens are the same in
  both layouts, only the prompts differ."""
  rows = np.asarray(rows)
  out = np.zeros((len(spans), width) + rows.shape[2:], rows.dtype)
  for i, (ps, pt, n) in enumerate(spans):
    out[i, ps:ps + n] = rows[i, pt:pt + n]
  return out


@dataclasses.dataclass
class SampledBatch:
  """One step's student rollouts on the host, stratified by teacher, waiting for scores."""

  arr: dict  # rollout.pad_batch arrays, rows in prompt order [B, T]
  index: np.ndarray  # teachers.stratify index: row of each (teacher, slot)
  tokens: jax.Array  # [K, b, T'] stratified, what the teachers score (their prompts)
  input_mask: jax.Array  # [K, b, T']
  cell_ids: np.ndarray  # [B] index into `cells`
  accuracy: np.ndarray  # [B] verifier score, 0 when unfinished or over budget
  lengths: np.ndarray  # [B] generated tokens
  over: np.ndarray  # [B] unfinished or past the cell's budget
  # Per row (student response start, teacher response start, length) when the teachers'
  # prompts differ from the student's; None when the teachers score the student's tokens.
  spans: Optional[list] = None
  examples: Optional[list] = None  # each real row's example: its prompt, re-rendered at will
  # Teachers of another tokenizer: each real row's `alignment.Alignment` of the student's
  # response to the teacher's tokens, None where the teacher could not take it (no reward).
  alignments: Optional[list] = None
  span_reward: str = "spread"  # how a span's reward reaches its tokens (StepSetup's)
  # Across tokenizers: (the student's, the teachers' or a tuple of each teacher's in router
  # order for teachers of several families).
  tokenizers: Optional[tuple] = None

  def student_layout(self, rows_BxT):
    """Teachers' per-row values ([B, T', ...]) on the student's positions ([B, T, ...])."""
    if self.spans is None:
      return np.asarray(rows_BxT)
    return realign(rows_BxT, self.spans, self.arr["tokens"].shape[1])


def teacher_view(tok, trajs: Sequence[rollout.Trajectory], examples: Sequence,
                 *, width_multiple: int = 32,
                     shown: Optional[Sequence[Optional[str]]] = None) -> tuple:
  """(padded arrays, spans) of the student's trajectories as the teachers score them: each
  response after its example's prompt rendered with the effort `shown` gives for its row
  (`views.PromptView.teacher` of the row's effort); None = every prompt without the effort
  (K3 eq. 15). `spans` as `realign` takes them, to bring the teacher's per-token values back
  to the student's positions."""
  shown = [None] * len(trajs) if shown is None else shown
  rows = [dataclasses.replace(t, prompt_ids=rollout.encode_prompt(tok, ex, e))
          for t, ex, e in zip(trajs, examples, shown)]
  spans = [(len(t.prompt_ids), len(v.prompt_ids), t.num_tokens) for t, v in zip(trajs, rows)]
  arr = rollout.pad_batch(rows, tok.pad_id, rollout.padded_width(
      max(len(v.prompt_ids) + v.num_tokens for v in rows), width_multiple))
  return arr, spans


@dataclasses.dataclass(frozen=True)
class StepSetup:
  """The fixed parts of a run's MOPD steps: the teacher `bank` (its router names each
  cell's teacher), the student's rollout `engine`, the `tasks` by domain that verify the
  rollouts, the grid's (domain, effort) `cells` in order, each effort's budget multiple
  `taus`, the padded width's multiple, and the `view` that gives the student's and the
  teachers' prompts."""
  bank: teachers.TeacherBank
  engine: rollout.RolloutEngine
  tasks: dict
  cells: Sequence[tuple]
  taus: dict
  width_multiple: int = 32
  view: views.PromptView = views.K3
  # Teachers of another tokenizer: theirs (None: the student's; a tuple of one per teacher,
  # router order, for teachers of several families) and how a span's reward reaches the
  # student's tokens (`alignment.token_rewards`).
  teacher_tok: Any = None
  span_reward: str = "spread"


def sample_batch(setup: StepSetup, params, examples_per_cell: Sequence[list], *, rng,
                 rows_per_teacher: Optional[int] = None,
                 pool: Optional[partial.RolloutPool] = None, step: int = 0) -> SampledBatch:
  """Steps 1-2 of a MOPD step: the student (`params`) samples one rollout per prompt, b
  prompts per (domain, effort) cell of `setup.cells` (`examples_per_cell`); rollouts are
  verified and laid out for the teachers.

  `rows_per_teacher`: the b of the teachers' [K, b, T] batch, each cell's rows padded to it
  (fixed, so that cells of varying size compile once); None = the first cell's size.
  `setup.view`: the student samples after its prompt (`view.student(e)`), each teacher
  scores the response after the prompt with `view.teacher(e)` (without the effort in K3
  eq. 15).
  `pool`: partial rollouts (`partial.py`): the step's prompts join the pool's in-flight
  rows, every incomplete row decodes one more segment, and the batch is the complete rows
  (at most b per cell, oldest first), padded with empty rows to K x b so that the update
  keeps one shape."""
  bank, engine, tasks, view = setup.bank, setup.engine, setup.tasks, setup.view
  rows, efforts = [], []
  for (d, e), exs in zip(setup.cells, examples_per_cell):
    rows += list(exs)
    efforts += [e] * len(exs)
  b = len(examples_per_cell[0]) if rows_per_teacher is None else rows_per_teacher
  domains = [ex.domain for ex in rows]
  if pool is not None:
    for j, d in enumerate(dict.fromkeys(domains)):  # the keys a one-go rollout would use
      idx = [i for i, dd in enumerate(domains) if dd == d]
      pool.add(engine, [rows[i] for i in idx], [view.student(efforts[i]) for i in idx],
               rng=jax.random.fold_in(rng, j), step=step)
    taken = []
    while not taken:  # the first steps may have nothing complete yet: decode on
      pool.advance(engine, params, rng, environment_of=lambda d: tasks[d].environment)
      taken = pool.take(engine, lambda r: (r.example.domain, r.effort), b)
    rows, efforts = [r.example for r in taken], [r.effort for r in taken]
    trajs = [r.traj for r in taken]
    texts = [engine.tok.decode(t.ids) for t in trajs]
    return _assemble(setup, rows, efforts, trajs=trajs, texts=texts, rows_per_teacher=b,
                     pad_to=bank.num_teachers * b)
  # Student rollouts: one per prompt, capped by the rollout length only (the teacher's
  # log-probs, not a budget penalty, teach the student how long each effort should be).
  res_by_domain = {}
  for d in dict.fromkeys(domains):
    idx = [i for i, dd in enumerate(domains) if dd == d]
    res_by_domain[d] = (idx, engine.run(
        params, [rows[i] for i in idx], [view.student(efforts[i]) for i in idx],
        budgets=[engine.max_response_tokens] * len(idx),
        rng=jax.random.fold_in(rng, len(res_by_domain)),
        environment=tasks[d].environment))
  trajs = [None] * len(rows)
  texts = [None] * len(rows)
  lengths = np.zeros(len(rows), int)  # in the tokens budgets are counted in
  for d, (idx, res) in res_by_domain.items():
    for j, i in enumerate(idx):
      trajs[i], texts[i] = res.trajectories[j], res.texts[j]
    lengths[idx] = res.lengths
  return _assemble(setup, rows, efforts, trajs=trajs, texts=texts, rows_per_teacher=b,
                   counted=lengths)


def _assemble(setup: StepSetup, rows, efforts, *, trajs, texts, rows_per_teacher: int,
              pad_to: int = 0, counted=None) -> SampledBatch:
  """The SampledBatch of rollouts `trajs` (decoded `texts`) of `rows` (examples) at
  `efforts`: verified, padded, stratified by teacher into `rows_per_teacher` rows each.
  `counted`: their lengths as the sampling engine's result measured them (None: measured
  here).
  `pad_to`: the student's batch gets empty rows (no loss tokens; weight 0 in every
  row-normalised loss) up to this many rows; the per-row diagnostics keep only the real
  rows."""
  bank, tok, tasks, cells, taus = (setup.bank, setup.engine.tok, setup.tasks, setup.cells,
                                   setup.taus)
  b, width_multiple, view = rows_per_teacher, setup.width_multiple, setup.view
  domains = [ex.domain for ex in rows]
  teacher_ids = [bank.router.index(d, e) for d, e in zip(domains, efforts)]
  budgets = np.asarray([task_base.budget(ex, taus[e]) for ex, e in zip(rows, efforts)])
  measured = setup.engine.result(trajs, budgets, texts=texts, counted=counted)
  lengths, over = measured.lengths, measured.over_budget
  acc = np.zeros(len(rows))
  for d in dict.fromkeys(domains):  # each domain's rows in one batch (a code sandbox pool)
    idx = [i for i, dd in enumerate(domains) if dd == d]
    acc[idx] = tasks[d].verify_unless([rows[i] for i in idx], [texts[i] for i in idx],
                                      over[idx], fill=0.0)
  empty = rollout.empty_rows(trajs[0], pad_to - len(trajs))
  longest = max(len(t.prompt_ids) + t.num_tokens for t in trajs)
  arr = rollout.pad_batch(list(trajs) + empty, tok.pad_id,
                          rollout.padded_width(longest, width_multiple))
  teacher_arr, spans, aligned = arr, None, None
  shown = [view.teacher(e) for e in efforts]
  if setup.teacher_tok is not None:  # the responses in the teachers' own tokens
    ttok = setup.teacher_tok
    if isinstance(ttok, (list, tuple)):  # several families: a row in its teacher's tokenizer
      ttok = [ttok[k] for k in teacher_ids]
    teacher_arr, spans, aligned = alignment.cross_view(
        tok, ttok, trajs, examples=rows, width_multiple=width_multiple, shown=shown)
    spans += [(0, 0, 0)] * len(empty)
  elif shown != [view.student(e) for e in efforts]:  # after the teachers' prompts
    teacher_arr, spans = teacher_view(tok, trajs, rows, width_multiple=width_multiple, shown=shown)
    spans += [(0, 0, 0)] * len(empty)
  index = teachers.stratify(np.asarray(teacher_ids), bank.num_teachers, b)
  strat = lambda x, fill=0: jnp.asarray(teachers.gather_stratified(x, index, fill))
  return SampledBatch(
      arr=arr, index=index, tokens=strat(teacher_arr["tokens"]),
      input_mask=strat(teacher_arr["input_mask"], False),
      cell_ids=np.asarray([cells.index((d, e)) for d, e in zip(domains, efforts)]),
      accuracy=acc, lengths=lengths, over=over, spans=spans, examples=list(rows),
      alignments=aligned, span_reward=setup.span_reward,
      tokenizers=None if aligned is None else (tok, setup.teacher_tok))


def train_on(trainer: train.Trainer, state: train.TrainState, bank: teachers.TeacherBank,
             *, sampled: SampledBatch, scored, r_max: float, alpha: float = 0.0,
             measure: Optional[Callable] = None):
  """Steps 3-4 once the teachers' scores `scored` are in (blocks on them): the update and
  the step's record. `scored` as `mopd_step`'s `score_fn` returns it. `measure(params,
  sampled, batch)`: (metrics, per-cell metrics) of diagnostics taken on the params the
  update starts from, before it and off its path (`diagnostics.py`: the exact KL's
  `kl_exact`, effort sensitivity, loss shares), merged into the step's record; None = none
  this step. `bank`: the teachers at their scoring temperature (its router names the cells;
  a loss computed with the teachers inside the update, `vocab_kl`, reads its params)."""
  arr, index = sampled.arr, sampled.index
  n = arr["tokens"].shape[0]  # the real rows (len(sampled.lengths)), then any empty ones
  scored = distributed.gather(scored)  # every host needs every row's scores
  topk, kind, char_counts = None, LOSS_KINDS[trainer.loss_cfg.kind], None
  if kind.char_targets:  # the teachers' next-character distributions (char_marginal.py)
    topk, char_mask, char_counts = char_marginal.topk_of(bank, sampled)
    arr = {**arr, "loss_mask": char_mask}
  elif kind.topk:
    if not isinstance(scored, tuple):
      raise ValueError("the top-k MOPD loss needs the teachers' top-k log-probs and ids: "
                       "score_fn must return (logprobs, topk_logprobs, topk_ids), e.g. a "
                       "placement.TeacherScorer built with top_k > 0")
    scored, tk_lp, tk_ids = scored
    topk = (sampled.student_layout(teachers.scatter_stratified(np.asarray(tk_lp), index, n)),
            sampled.student_layout(teachers.scatter_stratified(np.asarray(tk_ids), index, n)))
  scored_rows = teachers.scatter_stratified(np.asarray(scored), index, n)
  if sampled.alignments is not None:  # teachers of another tokenizer: rewards by spans
    teacher_lp = alignment.cross_teacher_logprobs(
        arr, scored_rows, spans=sampled.spans, alignments=sampled.alignments, r_max=r_max,
        assign=sampled.span_reward)
  else:
    teacher_lp = sampled.student_layout(scored_rows)
  lp_t = teachers.gather_stratified(teacher_lp, index)  # [K, b, T] on the student's positions
  # Outcome reward of a rollout: the verifier's score, 0 when unfinished or past its cell's
  # budget (the `accuracy` diagnostic), so the term also rewards keeping to the effort.
  adv = None
  if alpha:
    adv = np.zeros(n, np.float32)
    adv[:len(sampled.lengths)] = outcome_advantages(sampled.accuracy, sampled.cell_ids)
  batch = train_batch(arr, teacher_lp, topk=topk, alpha=alpha, advantages_B=adv)
  extra = None if measure is None else measure(state.params, sampled, batch)
  if LOSS_KINDS[trainer.loss_cfg.kind].teachers_in_step:  # donates the old params too
    state, m = vocab_kl.VocabKLStep.of(trainer).step(state, batch, bank=bank, sampled=sampled)
  else:
    state, m = trainer.step(state, batch)  # donates the old params: measured above
  m = {k: float(v) for k, v in jax.device_get(m).items()}
  cells_diag = cell_diagnostics(
      bank.router.names, index, teachers.gather_stratified(arr["sampler_logprobs"], index),
      lp_t_KxbxT=lp_t, mask_KxbxT=teachers.gather_stratified(arr["loss_mask"], index, False),
      r_max=r_max, sampled=sampled)
  m.update(accuracy=float(sampled.accuracy.mean()), length=float(sampled.lengths.mean()),
           over_budget=float(sampled.over.mean()), **(char_counts or {}))
  if sampled.alignments is not None:  # rows the teachers' tokenizer could not take
    m["unaligned_rows"] = float(sum(a is None for a in sampled.alignments))
    # The share of the teachers' tokens in spans of two or more of the student's tokens.
    s_n = [np.diff(a.student) for a in sampled.alignments if a is not None]
    t_n = [np.diff(a.teacher) for a in sampled.alignments if a is not None]
    total = sum(int(t.sum()) for t in t_n)
    m["teacher_multi_token_share"] = float(
        sum(int(t[s > 1].sum()) for s, t in zip(s_n, t_n)) / max(total, 1))
    for k, name in enumerate(bank.router.names):
      flat = index[k][index[k] >= 0]
      if name in cells_diag and len(flat):
        cells_diag[name]["unaligned"] = float(np.mean([sampled.alignments[i] is None
                                                       for i in flat]))
  if extra is not None:
    m.update(extra[0])
    for name, cm in extra[1].items():
      cells_diag.get(name, {}).update(cm)  # cells with rows in this batch
  return state, StepRecord(step=int(state.step), metrics=m, cells=cells_diag)


def mopd_step(trainer: train.Trainer, state: train.TrainState, setup: StepSetup, *,
              examples_per_cell: Sequence[list], rng, r_max: float, score_fn: Callable,
              alpha: float = 0.0):
  """One synchronous MOPD update on b prompts per (domain, effort) cell of `setup.cells`
  (`examples_per_cell`): `sample_batch`, teacher scoring, `train_on`. Returns (state,
  record).

  `score_fn(bank, tokens, mask)` returns the teachers' [K, b, T] log-probs, or for the top-k
  loss (a kind registered with `topk=True`) a tuple (log-probs, top-k log-probs [K, b, T, k],
  top-k ids). `alpha` > 0 adds the outcome term alpha * `outcome_advantages` (REINFORCE).
  `setup.view`: which effort the student's and the teachers' prompts carry (`sample_batch`).
  """
  bank = setup.bank
  sampled = sample_batch(setup, state.params, examples_per_cell, rng=rng)
  scored = score_fn(bank, sampled.tokens, sampled.input_mask)
  return train_on(trainer, state, bank, sampled=sampled, scored=scored, r_max=r_max, alpha=alpha)
