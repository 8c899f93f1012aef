"""The mopd stage: the student, from pi_SFT (or the teacher-SFT initialisation), distilled
from the grid's teachers on its own rollouts (mopd_jax/training/mopd.py), each prompt scored by the
teacher of its (domain, effort) cell.

`mopd.staleness` 1 runs the same steps through `async_scoring.run`: the teachers score
batch k while the student samples batch k+1, and the stale batch is importance-weighted.
The student checkpoint holds only the student's TrainState: teachers are loaded from the
manifest on every (re)start and never saved with it.

`teacher.endpoints` scores against teacher servers instead (`mopd_jax/teachers/client.py`;
`python -m mopd_jax.serve`, or vLLM): each server is checked at start (vocabulary, tokenizer
fingerprint, temperature, cells), a step's requests go out when its rollouts are ready, and
a server that stays down stops the run (`TeacherUnavailable`) with the last checkpoint kept.
The bank's params are then loaded only for what runs in this process: the teacher-SFT
initialisation's teacher rollouts and the exact-KL diagnostic (co-located placement).

The stage takes its inputs explicitly (`Inputs`, which the pipeline builds:
`mopd_jax/stages/wiring.py`); the loop's state between steps lives in a `Distillation`,
whose methods are the callbacks of `async_scoring.run`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Optional, Union

import jax
import numpy as np
from jax.sharding import Mesh

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.io import checkpoint, tokenizer
from mopd_jax.rollout import partial, turns as rollout
from mopd_jax.stages import loops, mopd_init, sources
from mopd_jax.tasks import base as task_base, grid as grid_mod, views
from mopd_jax.teachers import (async_scoring, bank as teachers,
                               client as teacher_client, parity, placement, relayed)
from mopd_jax.training import diagnostics, mopd, step as train, vocab_kl

IN_FLIGHT = "_in_flight"  # the data state's entry of the partial-rollout pool (not a domain)
# mopd/start.json: the exact KL of pi_SFT, before the teacher-SFT initialisation, to the
# routed teachers (`measure_start`); the report's KL drop starts there.
START = "start.json"


# A text every tokenizer can encode: a vLLM server is checked by tokenizing it.
PROBE_TEXT = "12+30=42"




@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the mopd stage reads and works with; `wiring.mopd_inputs` builds it from the run.

  `bank`: the grid's teachers (their params, or the router alone when servers score and
  nothing here needs the params); `scoring`: the bank at `mopd.teacher_temperature`, what
  scores and what the exact KL measures against; `scorer`: in-process
  (`placement.TeacherScorer`) or the servers' client (`teacher_client.EndpointScorer`);
  `engine`: the student's sampler, `teacher_engine` the teachers' (the teacher-SFT init);
  `data.iterator(domain, batch_size, salt)`: a domain's training batches; `policies`: the
  student's params (pi_SFT's loaded from the workdir)."""
  cfg: config_mod.MopdConfig
  sft: config_mod.SftConfig  # the teacher-SFT init's batch size
  seed: int
  grid: grid_mod.Grid
  view: views.PromptView
  tok: Any
  # The teachers' tokenizer: `tok`, or their own (teacher.tokenizer_path), or a tuple of each
  # teacher's (router order) for teachers of several families (`families.MixedBank`).
  teacher_tok: Any
  model_cfg: models.ModelConfig
  mesh: Mesh
  tasks: Mapping[str, task_base.Task]
  engine: rollout.RolloutEngine
  teacher_engine: Optional[rollout.RolloutEngine]  # None with several families
  bank: teachers.TeacherBank
  scoring: teachers.TeacherBank
  scorer: Union[placement.TeacherScorer, teacher_client.EndpointScorer]
  colocated: bool  # teachers on the student's devices: the exact KL can run
  data: sources.DataSource
  policies: sources.Policies
  files: loops.Workdir
  loops: loops.Loops
  # Served teachers: the parity probe every `teacher.probe_every` steps (teachers/parity.py).
  parity_monitor: Optional[parity.Monitor] = None
  span_reward: str = "spread"  # teachers of another tokenizer: `teacher.span_reward`
  # Teachers of several families: each family's sampling engine (bank.families' order).
  teacher_engines: tuple = ()
  # Served teachers and the char_kl loss: the servers' top-k (`char_served.Served`).
  char_source: Any = None

  @property
  def cross(self) -> bool:
    """Teachers of another tokenizer: rewards by aligned spans (`teachers/alignment.py`)."""
    return self.teacher_tok is not self.tok

  @property
  def served(self) -> bool:
    return isinstance(self.scorer, (teacher_client.EndpointScorer, relayed.Relayed))

  def budgets(self, examples, effort: str) -> list:
    return task_base.effort_budgets(examples, effort, self.grid.taus)


def endpoint_scorer(cells, endpoints: str, *, policy, top_k: int, student: dict,
                    api_key=None, parity: bool = False):
  """The client of `teacher.endpoints` (`cells` -> URLs), its servers checked against the
  `student`: {vocab_size, tokenizer, temperature, max_len (its longest row), and `whose`
  when the vocabulary and tokenizer are the run's teachers' of another tokenizer}, or with
  teachers of several families a list of such, one per family, each naming its `cells`
  (their servers checked against it). `parity`: the parity probe will compare the servers
  with the run's own teachers. In a run of several processes process 0 alone holds the
  client and relays what it gets (`relayed.Relayed`)."""
  def build():
    scorer = teacher_client.EndpointScorer(cells, endpoints, policy=policy, top_k=top_k,
                                           api_key=api_key)
    try:
      for one in ([student] if isinstance(student, Mapping) else student):
        tok = one["tokenizer"]  # with teachers of several families, each family's servers
        scorer.check(vocab_size=one["vocab_size"], tokenizer_hash=tokenizer.fingerprint(tok),
                     temperature=one["temperature"],
                     probe=(PROBE_TEXT, tok.encode(PROBE_TEXT)), max_len=one.get("max_len", 0),
                     parity=parity, whose=one.get("whose", "the student's"),
                     only=one.get("cells"))
    except ValueError as e:  # a server for another student: one `config error:` line
      scorer.close()
      raise config_mod.ConfigError(str(e)) from e
    return scorer
  return relayed.Relayed(build) if jax.process_count() > 1 else build()


def run(inp: Inputs) -> None:
  c = inp.cfg
  pool = partial.RolloutPool(c.partial_rollout_tokens) if c.partial_rollout_tokens else None
  weighted = c.staleness or (pool is not None and c.partial_mode == "importance")
  loss_cfg = train.LossConfig(kind=c.loss, r_max=c.r_max,
                              is_bounds=tuple(c.is_bounds) if weighted else None,
                              args=c.loss_args)
  trainer = train.Trainer(inp.model_cfg, loss_cfg,
                          train.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps,
                                            total_steps=c.steps, microbatches=c.microbatches,
                                            length_groups=c.length_groups),
                          mesh=inp.mesh)
  dist = Distillation(inp, trainer=trainer, loss_cfg=loss_cfg, pool=pool)
  log = inp.loops.logger("mopd")
  t0 = time.time()
  with inp.loops.training("mopd", inp.files.path("mopd", "ckpt"), trainer, total_steps=c.steps,
                          init=dist.start_state, data_state=dist.data_state,
                          restore_data=dist.restore_data) as (loop, state, bar):
    record = StepRecord(dist, loop=loop, bar=bar, log=log)
    try:
      state, _, times = async_scoring.run(state, c.steps, sample=dist.sample, submit=dist.submit,
                                          train=dist.train, staleness=c.staleness,
                                          on_step=record, start_step=loop.start_step)
    except (teacher_client.TeacherUnavailable, parity.ParityError) as e:
      # The failed step never trained (or, a probe failing, trained on scores the probe
      # before it vouched for); the last finished one is kept, so the same command continues
      # once the servers are back or fixed.
      if record.latest:
        loop.save(record.latest["done"], record.latest["state"])
      raise teacher_client.TeacherUnavailable(
          f"{e}; last checkpoint: step {loop.last_saved} in {loop.directory}; restart (or "
          "fix) the server and run the same command to continue") from None
    finally:
      if inp.served:
        inp.scorer.close()
      if inp.char_source is not None:
        inp.char_source.close()
    history = loop.history
  log.close()
  checkpoint.save_params(inp.files.path("mopd", "params"), state.params)
  checkpoint.write_json(inp.files.path("mopd", "history.json"), history)
  inp.files.mark_done("mopd", {"steps": c.steps, "seconds": time.time() - t0,
                               "staleness": c.staleness,
                               "partial_rollout_tokens": c.partial_rollout_tokens,
                               "phase_seconds_per_step": times.per_step(),
                               "seconds_outside_steps": {"start_kl": dist.seconds["start_kl"],
                                                         "init": dist.seconds["init"]},
                               "diagnostics_seconds": dist.seconds["diagnostics"],
                               "kl_initial": history[0]["kl"], "kl_final": history[-1]["kl"]})


class Distillation:
  """The MOPD loop between its steps: the data streams and where each step's prompts were
  drawn, the partial-rollout pool, the diagnostics' schedule. Its methods are the callbacks
  `async_scoring.run` calls (`sample`, `submit`, `train`), the checkpoint's data hooks
  (`data_state`, `restore_data`) and a fresh run's start (`start_state`)."""

  def __init__(self, inp: Inputs, *, trainer: train.Trainer, loss_cfg: train.LossConfig,
               pool=None):
    c, grid = inp.cfg, inp.grid
    self.inp, self.trainer, self.pool = inp, trainer, pool
    self.setup = mopd.StepSetup(inp.bank, inp.engine, inp.tasks, grid.cells, grid.taus,
                                view=inp.view, teacher_tok=inp.teacher_tok if inp.cross else None,
                                span_reward=inp.span_reward)
    self.shared = c.prompts_across_efforts == "shared"
    self.mix = tuple(c.effort_mix)
    self.n_eff = len(grid.efforts)
    self.iters = {d: inp.data.iterator(d, c.prompts_per_cell * (1 if self.shared else self.n_eff),
                                  salt=200 + i) for i, d in enumerate(grid.domains)}
    self.streams = loops.Streams(self.iters)
    # Iterator positions before each step's prompts were drawn: with staleness 1 the next
    # step's prompts are already drawn when a step is checkpointed, and a resumed run must
    # draw them again.
    self.drawn_at, self.last_step = {}, -1
    # The exact KL diagnostic needs the student and the teachers on the same devices, over
    # one vocabulary.
    self.every = c.exact_kl_every if inp.colocated and not inp.cross else 0
    if c.exact_kl_every and not self.every:
      print("[mopd] mopd.exact_kl_every: the exact KL needs co-located teachers of the "
            "student's vocabulary; only the sampled (span) log-ratio is reported")
    # Effort sensitivity and loss shares (diagnostics.py): on the first and the last step
    # only (on the toy they cost about one update each, more than the exact KL); the exact
    # KL every `every` steps and on those two.
    self.probe = diagnostics.Probe(inp.model_cfg, loss_cfg, inp.tok, tuple(grid.cells),
                                   grid.effort_names)
    # Wall seconds of this run's start (pi_SFT's exact KL; the teacher-SFT init: its teacher
    # rollouts and updates) and of the steps' diagnostics (inside the steps' `train` phase).
    self.seconds = {"start_kl": 0.0, "init": 0.0, "diagnostics": 0.0}

  def data_state(self) -> dict:
    data = self.drawn_at.get(self.last_step + 1) or self.streams.state()
    return data if self.pool is None else {**data, IN_FLIGHT: self.pool.state()}

  def restore_data(self, data: dict) -> None:
    if IN_FLIGHT in data:
      self.pool.restore(data[IN_FLIGHT])
    self.streams.restore({d: pos for d, pos in data.items() if d != IN_FLIGHT})

  def start_state(self) -> train.TrainState:
    """The state a fresh run starts from: pi_SFT at `mopd.start_temperature` (its logits
    divided by it), after the teacher-SFT initialisation when `mopd.init` asks for it."""
    inp = self.inp
    sft = inp.policies.load(inp.files.path("sft", "params"))
    student = models.with_temperature(sft, inp.cfg.start_temperature)
    if inp.cfg.init == "teacher_sft":
      t = time.time()
      self.measure_start(sft)  # pi_SFT as trained: the report's KL drop starts there
      self.seconds["start_kl"] = time.time() - t
      student, pool_size = mopd_init.teacher_sft_init(inp, student)
      # The initialised student, for the eval's held-out KL of the init alone and of the
      # on-policy steps alone (`loops.INIT_PARAMS`).
      checkpoint.save_params(inp.files.path("mopd", loops.INIT_PARAMS), student)
      self.seconds["init"] = time.time() - t - self.seconds["start_kl"]
      print(f"[mopd] student initialised by SFT on "
            f"{pool_size if pool_size is not None else 'restored'} teacher trajectories")
    return self.trainer.init(student)

  def sample(self, params, step: int):
    inp, c = self.inp, self.inp.cfg
    self.drawn_at[step] = self.streams.state()
    # Effort draws: a pure function of (seed, step), so a resumed run draws the same.
    per_cell = mopd.cell_prompts(self.iters, inp.grid, c.prompts_per_cell, shared=self.shared,
                                 mix=self.mix, rng=np.random.RandomState([inp.seed, step]))
    rng = jax.random.fold_in(jax.random.PRNGKey(inp.seed + 3), step)
    sampled = mopd.sample_batch(
        self.setup, params, per_cell, rng=rng,
        rows_per_teacher=c.prompts_per_cell * (self.n_eff if self.mix else 1), pool=self.pool,
        step=step)
    if self.pool is not None and c.partial_mode == "recompute":
      sampled.arr = partial.recompute_logprobs(inp.model_cfg, params, sampled.arr)
    return sampled

  @property
  def scores(self):
    """What scores each step's batch: the scorer, or with served `char_kl` targets their
    clients, whose one request per family gives eq. 15's scores and the top-k together."""
    return self.inp.char_source or self.inp.scorer

  def submit(self, sampled):  # dispatched without blocking: JAX's async dispatch
    return self.scores.submit(sampled.tokens, sampled.input_mask)

  def measure(self, step: int):
    """The diagnostics of `step` as a `train_on` hook, or None when none are due."""
    inp = self.inp
    steps = inp.cfg.steps
    ends = step in (0, steps - 1)
    # The KL-drop result averages the last tenth of the steps (kl_curves.kl_windows): each of
    # them is measured, as one step's value alone moves several-fold with its rollouts.
    last_tenth = step >= steps - max(1, steps // 10)
    exact = bool(self.every) and (step % self.every == 0 or ends or last_tenth)
    if not exact and not ends:
      return None

    def fn(params, sampled, batch):
      t = time.time()
      out = [self.probe.measure(params, sampled, batch)] if ends else []
      if exact:
        kl = vocab_kl.exact_kl_rows(inp.model_cfg, params, inp.scoring, sampled=sampled)
        out.insert(0, diagnostics.exact_kl_means(kl, sampled, inp.bank.router.names))
      merged = diagnostics.merge(*out)  # host floats: the measurement has finished
      self.seconds["diagnostics"] += time.time() - t
      return merged
    return fn

  def train(self, state, sampled, scored):
    c = self.inp.cfg
    step = int(state.step)
    # The scoring bank: the teachers at mopd.teacher_temperature, with the bank's router
    # (served and char_kl: the servers' top-k, read for the next-character targets).
    teachers_now = self.inp.char_source or self.inp.scoring
    state, rec = mopd.train_on(self.trainer, state, teachers_now, sampled=sampled,
                               scored=self.scores.fetch(scored), r_max=c.r_max,
                               alpha=c.alpha, measure=self.measure(step))
    if self.pool is not None:  # rows still decoding, and the trained rows' count
      rec.metrics.update(in_flight=float(len(self.pool.rows)),
                         rows=float(len(sampled.lengths)))
    return state, rec

  def measure_start(self, student) -> None:
    """The exact KL of the student's starting policy (pi_SFT, before the teacher-SFT
    initialisation) to its routed teachers, on its own rollouts of the first step's prompts:
    where the distillation starts. The data streams are put back, so the run draws the
    same prompts as without it."""
    inp = self.inp
    if not self.every or self.pool is not None or inp.cfg.init != "teacher_sft":
      return
    states = self.streams.state()
    sampled = self.sample(student, 0)
    self.drawn_at.pop(0, None)
    self.streams.restore(states)
    overall, cells = diagnostics.exact_kl_means(
        vocab_kl.exact_kl_rows(inp.model_cfg, student, inp.scoring, sampled=sampled), sampled,
        inp.bank.router.names)
    checkpoint.write_json(inp.files.path("mopd", START), {"policy": "sft", **overall,
                                                          "cells": cells})


class StepRecord:
  """What follows each MOPD step (`async_scoring.run`'s `on_step`): the step's record in
  the checkpointed loop, the progress bar, the metric log, and `latest`, the state after the
  last finished step (saved if the teachers go away)."""

  def __init__(self, dist: Distillation, *, loop, bar, log):
    self.dist, self.loop, self.bar, self.log = dist, loop, bar, log
    self.latest = {}

  def __call__(self, step: int, state, rec) -> None:
    self.dist.last_step = step
    self.dist.drawn_at.pop(step, None)
    inp, extra, gaps = self.dist.inp, {}, None
    monitor = inp.parity_monitor
    if monitor is not None and inp.served and monitor.due(step):
      gaps = monitor.measure(inp.scorer)
      extra = {"parity_gaps": gaps}
      rec.metrics["parity_gap"] = max(gaps.values())
    self.loop.end_step(step, state, rec.metrics, record={"step": step, **rec.metrics,
                                                         "cells": rec.cells, **extra})
    self.bar.update(rec.metrics, keys=("loss", "kl", "accuracy", "length"))
    self.log.scalars(step, rec.metrics)
    for name, cm in rec.cells.items():
      self.log.scalars(step, cm, prefix=f"{name}/")
    if gaps is not None:
      self.log.scalars(step, gaps, prefix="parity_gap/")
    # A probe that fails keeps this step as the last one (saved by `run`); the error names
    # the step, and the steps since the last passed probe trained on the drifting scores.
    self.latest.update(done=step + 1, state=state)
    if gaps is not None:
      monitor.check(gaps, step=step, what=f"teacher.endpoints={list(inp.scorer.urls)}")
