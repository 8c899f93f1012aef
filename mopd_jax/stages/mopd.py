"""The mopd stage: the student, from pi_SFT (or the teacher-SFT initialisation), distilled
from the grid's teachers on its own rollouts (mopd_jax/mopd.py), each prompt scored by the
teacher of its (domain, effort) cell.

`mopd.staleness` 1 runs the same steps through `async_scoring.run`: the teachers score
batch k while the student samples batch k+1, and the stale batch is importance-weighted.
The student checkpoint holds only the student's TrainState: teachers are loaded from the
manifest on every (re)start and never saved with it.

`teacher.endpoints` scores against teacher servers instead (`mopd_jax/teacher_client.py`;
`python -m mopd_jax.serve`, or vLLM): each server is checked at start (vocabulary, tokenizer
fingerprint, temperature, cells), a step's requests go out when its rollouts are ready, and
a server that stays down stops the run (`TeacherUnavailable`) with the last checkpoint kept.
The bank's params are then loaded only for what runs in this process: the teacher-SFT
initialisation's teacher rollouts and the exact-KL diagnostic (co-located placement).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from mopd_jax import (async_scoring, checkpoint, config as config_mod, diagnostics, models,
                      mopd, partial, placement, rollout, teacher_client, teachers, tokenizer,
                      train)
from mopd_jax.stages.context import Run

IN_FLIGHT = "_in_flight"  # the data state's entry of the partial-rollout pool (not a domain)
# mopd/start.json: the exact KL of pi_SFT, before the teacher-SFT initialisation, to the
# routed teachers (`measure_start`); the report's KL drop starts there.
START = "start.json"


# A text every tokenizer can encode: a vLLM server is checked by tokenizing it.
PROBE_TEXT = "12+30=42"


def endpoint_scorer(ctx: Run, top_k: int) -> teacher_client.EndpointScorer:
  """The client of `teacher.endpoints`, its servers checked against the student."""
  if jax.process_count() > 1:
    raise ValueError("teacher.endpoints scores from a single process; run the trainer as one "
                     "process or use placement.teachers")
  c = ctx.config
  scorer = teacher_client.EndpointScorer(ctx.grid.names, c.teacher.endpoints,
                                         policy=c.teacher.retry_policy(), top_k=top_k)
  try:
    scorer.check(vocab_size=ctx.model_cfg.vocab_size,
                 tokenizer_hash=tokenizer.fingerprint(ctx.tok),
                 temperature=c.mopd.teacher_temperature,
                 probe=(PROBE_TEXT, ctx.tok.encode(PROBE_TEXT)))
  except ValueError as e:  # a server for another student: one `config error:` line
    scorer.close()
    raise config_mod.ConfigError(str(e)) from e
  return scorer


def run(ctx: Run) -> None:
  c, grid = ctx.config.mopd, ctx.grid
  served = bool(ctx.config.teacher.endpoints)
  colocated = ctx.config.placement.teachers == "colocated"
  top_k = c.top_k if c.loss == "topk" else 0
  # With teacher servers this process reads the teachers' params only for what runs here:
  # the teacher-SFT init's rollouts and the exact-KL diagnostic.
  if served and c.init != "teacher_sft" and not (c.exact_kl_every and colocated):
    bank = teachers.TeacherBank(params={}, model_cfg=ctx.teacher_cfg,
                                router=teachers.Router(grid.names))  # the router alone
  else:
    bank = ctx.load_bank()
  staleness = c.staleness
  # Partial rollouts: the in-flight trajectories, carried across steps and checkpoints.
  pool = partial.RolloutPool(c.partial_rollout_tokens) if c.partial_rollout_tokens else None
  weighted = staleness or (pool is not None and c.partial_mode == "importance")
  loss_cfg = train.LossConfig(kind=c.loss, r_max=c.r_max,
                              is_bounds=tuple(c.is_bounds) if weighted else None)
  trainer = train.Trainer(ctx.model_cfg, loss_cfg,
                          train.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps,
                                            total_steps=c.steps, microbatches=c.microbatches),
                          mesh=ctx.mesh)
  tasks = {d: ctx.task(d) for d in grid.domains}
  setup = mopd.StepSetup(bank, ctx.engine, tasks, grid.cells, ctx.taus, view=ctx.view)
  shared = c.prompts_across_efforts == "shared"
  mix = tuple(c.effort_mix)
  n_eff = len(grid.efforts)
  iters = {d: ctx.iterator(d, c.prompts_per_cell * (1 if shared else n_eff), salt=200 + i)
           for i, d in enumerate(grid.domains)}
  # Co-located or disaggregated (config.placement): log-probs come back on the student mesh.
  # The teachers score at `mopd.teacher_temperature`, and sample the teacher_sft init's
  # trajectories at it: the student is initialised on, and distilled from, the same
  # distribution.
  scoring = bank if not bank.params else bank.replace(
      params=models.with_temperature(bank.params, c.teacher_temperature))
  if served:
    scorer = endpoint_scorer(ctx, top_k)
  else:
    scorer = placement.TeacherScorer(scoring, ctx.mesh, ctx.teacher_mesh, top_k=top_k)
  log = ctx.logger("mopd")
  t0 = time.time()
  # Iterator positions before each step's prompts were drawn: with staleness 1 the next
  # step's prompts are already drawn when a step is checkpointed, and a resumed run must
  # draw them again.
  drawn_at, last_step = {}, [-1]

  def data_state():
    data = drawn_at.get(last_step[0] + 1) or {d: it.state() for d, it in iters.items()}
    return data if pool is None else {**data, IN_FLIGHT: pool.state()}

  def restore_data(data):
    for d, pos in data.items():
      if d == IN_FLIGHT:
        pool.restore(pos)
      else:
        iters[d].restore(pos)

  def sample(params, step):
    drawn_at[step] = {d: it.state() for d, it in iters.items()}
    # Effort draws: a pure function of (seed, step), so a resumed run draws the same.
    per_cell = mopd.cell_prompts(iters, grid, c.prompts_per_cell, shared=shared, mix=mix,
                                 rng=np.random.RandomState([ctx.config.seed, step]))
    rng = jax.random.fold_in(jax.random.PRNGKey(ctx.config.seed + 3), step)
    sampled = mopd.sample_batch(
        setup, params, per_cell, rng=rng,
        rows_per_teacher=c.prompts_per_cell * (n_eff if mix else 1), pool=pool, step=step)
    if pool is not None and c.partial_mode == "recompute":
      sampled.arr = partial.recompute_logprobs(ctx.model_cfg, params, sampled.arr)
    return sampled

  def submit(sampled):  # dispatched without blocking: JAX's async dispatch
    return scorer.submit(sampled.tokens, sampled.input_mask)

  # The exact KL diagnostic needs the student and the teachers on the same devices.
  every = c.exact_kl_every if colocated else 0
  if c.exact_kl_every and not every:
    print("[mopd] mopd.exact_kl_every: the exact KL needs co-located teachers; only the "
          "sampled-token KL estimate is reported")

  # Effort sensitivity and loss shares (diagnostics.py): on the first and the last step
  # only (on the toy they cost about one update each, more than the exact KL); the exact KL
  # every `every` steps and on those two.
  probe = diagnostics.Probe(ctx.model_cfg, loss_cfg, ctx.tok, tuple(grid.cells),
                            grid.effort_names)

  def measure(step):
    ends = step in (0, c.steps - 1)
    exact = bool(every) and (step % every == 0 or ends)
    if not exact and not ends:
      return None

    def fn(params, sampled, batch):
      out = [probe.measure(params, sampled, batch)] if ends else []
      if exact:
        kl = mopd.exact_kl_rows(ctx.model_cfg, params, scoring, sampled=sampled)
        out.insert(0, diagnostics.exact_kl_means(kl, sampled, bank.router.names))
      return diagnostics.merge(*out)
    return fn

  def train_fn(state, sampled, scored):
    step = int(state.step)
    state, rec = mopd.train_on(trainer, state, bank, sampled=sampled, scored=scorer.fetch(scored),
                               r_max=c.r_max, alpha=c.alpha, measure=measure(step))
    if pool is not None:  # rows still decoding, and the trained rows' count
      rec.metrics.update(in_flight=float(len(pool.rows)), rows=float(len(sampled.lengths)))
    return state, rec

  def measure_start(student):
    """The exact KL of the student's starting policy (pi_SFT, before the teacher-SFT
    initialisation) to its routed teachers, on its own rollouts of the first step's prompts:
    where the distillation starts. The data streams are put back, so the run draws the
    same prompts as without it."""
    if not every or pool is not None or c.init != "teacher_sft":
      return
    states = {d: it.state() for d, it in iters.items()}
    sampled = sample(student, 0)
    drawn_at.pop(0, None)
    for d, pos in states.items():
      iters[d].restore(pos)
    overall, cells = diagnostics.exact_kl_means(
        mopd.exact_kl_rows(ctx.model_cfg, student, scoring, sampled=sampled), sampled,
        bank.router.names)
    checkpoint.write_json(ctx.path("mopd", START), {"policy": "sft", **overall,
                                                    "cells": cells})

  def init():
    student = checkpoint.load_params(ctx.path("sft", "params"), ctx.params_like())
    if c.init == "teacher_sft":
      measure_start(student)
      student, pool_size = teacher_sft_init(ctx, student, bank)
      print(f"[mopd] student initialised by SFT on "
            f"{pool_size if pool_size is not None else 'restored'} teacher trajectories")
    return trainer.init(student)

  with ctx.training("mopd", ctx.path("mopd", "ckpt"), trainer, total_steps=c.steps, init=init,
                    data_state=data_state, restore_data=restore_data) as (loop, state, bar):

    def on_step(step, state, rec):
      last_step[0] = step
      drawn_at.pop(step, None)
      loop.end_step(step, state, rec.metrics, record={"step": step, **rec.metrics,
                                                      "cells": rec.cells})
      bar.update(rec.metrics, keys=("loss", "kl", "accuracy", "length"))
      log.scalars(step, rec.metrics)
      for name, cm in rec.cells.items():
        log.scalars(step, cm, prefix=f"{name}/")
      latest.update(done=step + 1, state=state)

    latest = {}  # the state after the last finished step: saved if the teachers go away
    try:
      state, _, times = async_scoring.run(state, c.steps, sample=sample, submit=submit,
                                          train=train_fn, staleness=staleness,
                                          on_step=on_step, start_step=loop.start_step)
    except teacher_client.TeacherUnavailable as e:
      # The failed step never trained; the last finished one is kept, so the same command
      # continues once the server is back.
      if latest:
        loop.save(latest["done"], latest["state"])
      raise teacher_client.TeacherUnavailable(
          f"{e}; last checkpoint: step {loop.last_saved} in {loop.directory}; restart the "
          "server and run the same command to continue") from None
    finally:
      if served:
        scorer.close()
    history = loop.history
  log.close()
  checkpoint.save_params(ctx.path("mopd", "params"), state.params)
  checkpoint.write_json(ctx.path("mopd", "history.json"), history)
  ctx.mark_done("mopd", {"steps": c.steps, "seconds": time.time() - t0, "staleness": staleness,
                         "partial_rollout_tokens": c.partial_rollout_tokens,
                         "phase_seconds_per_step": times.per_step(),
                         "kl_initial": history[0]["kl"], "kl_final": history[-1]["kl"]})


def teacher_sft_init(ctx: Run, student, bank: teachers.TeacherBank):
  """pi_SFT further fine-tuned on trajectories of every teacher, each after the student's
  prompt with its effort (K3 §4.1.2): rollouts of teacher (d, e) on training prompts (as
  the teacher sees them) at effort e's budget, kept when
  they finish within the cell's budget, then SFT on the pooled set. Returns (params, pool
  size); the pool size is None when a restart found the init already finished."""
  c = ctx.config.mopd
  total = c.init_sft_steps
  trainer = train.Trainer(ctx.model_cfg, train.LossConfig(kind="sft"),
                          train.OptimConfig(lr=ctx.config.sft.lr, warmup_steps=0,
                                            total_steps=total, microbatches=c.microbatches),
                          mesh=ctx.mesh)
  with ctx.training("mopd init: teacher SFT", ctx.path("mopd", "init_ckpt"), trainer,
                    total_steps=total,
                    init=lambda: trainer.init(student)) as (loop, state, bar):
    if loop.start_step == total:
      return state.params, None  # finished before a restart: no need to rebuild the pool
    pool = teacher_pool(ctx, bank)  # deterministic: rebuilt alike after a restart
    # One width for the whole pool: one compilation.
    width = rollout.padded_width(max(len(t.prompt_ids) + len(t.ids) for t in pool))
    for step in range(loop.start_step, total):
      # A pure function of (seed, step): a resumed init draws the same batches.
      rng = np.random.RandomState([ctx.config.seed + 500, step])
      picks = [pool[i] for i in rng.randint(len(pool), size=ctx.config.sft.batch_size)]
      state, m = trainer.step(state, train.TrainBatch.from_padded(
          rollout.pad_batch(picks, ctx.tok.pad_id, width)))
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      loop.end_step(step, state, m, record=[step, m["loss"]])
      bar.update(m)
  return state.params, len(pool)


def teacher_pool(ctx: Run, bank: teachers.TeacherBank) -> list:
  """Teacher trajectories that finished within their cell's budget: each teacher samples
  after its own prompt (`view.teacher(e)`), the student trains on the response after its
  prompt (`view.student(e)`)."""
  c = ctx.config.mopd
  pool = []
  for k, name in enumerate(bank.router.names):
    d, e = name.split("/")
    tparams = jax.tree.map(lambda x, k=k: x[k], bank.params)
    exs = next(ctx.iterator(d, c.init_samples_per_cell, salt=300 + k))
    res = ctx.make_engine(ctx.teacher_cfg, c.teacher_temperature).run(
        tparams, exs, [ctx.view.teacher(e)] * len(exs), budgets=ctx.budgets(exs, e),
        rng=jax.random.PRNGKey(ctx.config.seed + 400 + k), environment=ctx.task(d).environment)
    # The student learns the teacher's response after its own prompt (`view.student(e)`).
    pool += [dataclasses.replace(t, prompt_ids=rollout.encode_prompt(ctx.tok, ex,
                                                                     ctx.view.student(e)))
             for t, ex, over in zip(res.trajectories, exs, res.over_budget) if not over]
  if not pool:
    raise RuntimeError("no teacher trajectory finished within its budget; cannot build the "
                       "teacher-SFT initialisation")
  return pool
