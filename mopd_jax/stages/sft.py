"""The sft stage: pi_SFT on every domain's mixed-style data, one domain per update (each
batch padded to its own length), QAT from here on. With `teacher.outside_cell` set, also the
outside SFT (its own seed: init, data order and effort tokens differ) under sft/outside/.
With `sft.steps=0` the initial policy (`model.hf_path`, e.g. an instruction-tuned model) is
pi_SFT as it is. The stage takes its `Inputs` (built by `stages/wiring.py`)."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from jax.sharding import Mesh

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.io import checkpoint, storage
from mopd_jax.rollout import turns as rollout
from mopd_jax.stages import loops, sources
from mopd_jax.tasks import grid as grid_mod, views
from mopd_jax.training import sft, step as train


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the sft stage reads and works with. `outside`: (cell, seed) of the
  outside-teacher ablation ("" = none); `data.iterator(domain, batch_size, salt, seed=)`: a
  domain's training batches in `seed`'s order; `policies.initial(seed)`: the policy SFT
  starts from; `source`: where it comes from (`model.hf_path`, or "" for a fresh init)."""
  cfg: config_mod.SftConfig
  seed: int
  outside: tuple
  log_every: int
  grid: grid_mod.Grid
  view: views.PromptView
  tok: Any
  model_cfg: models.ModelConfig
  mesh: Mesh
  data: sources.DataSource
  policies: sources.Policies
  source: str
  files: loops.Workdir
  loops: loops.Loops


def run(inp: Inputs) -> None:
  t0 = time.time()
  if inp.cfg.steps == 0:
    checkpoint.save_params(inp.files.path("sft", "params"), inp.policies.initial())
    inp.files.mark_done("sft", {"steps": 0, "final_loss": None, "seconds": time.time() - t0,
                                "loss_curve": [], "source": inp.source or "init"})
    return
  state, history = train_sft(inp, inp.seed, "sft", directory=inp.files.path("sft"))
  checkpoint.save_params(inp.files.path("sft", "params"), state.params)
  info = {"steps": inp.cfg.steps, "final_loss": history[-1][1],
          "seconds": time.time() - t0, "loss_curve": history}
  cell, seed = inp.outside
  if cell:
    state, hist = train_sft(inp, seed, "sft outside", directory=inp.files.path("sft", "outside"))
    checkpoint.save_params(inp.files.path("sft", "outside", "params"), state.params)
    info["outside"] = {"cell": cell, "seed": seed, "final_loss": hist[-1][1],
                       "loss_curve": hist}
  inp.files.mark_done("sft", info)


def train_sft(inp: Inputs, seed: int, name: str, *, directory: str):
  """One SFT run of `seed` (init, data order, batch rng), checkpointed under `directory`;
  returns (state, loss history)."""
  c = inp.cfg
  trainer = train.Trainer(inp.model_cfg, train.LossConfig(kind="sft"),
                          train.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps,
                                            total_steps=c.steps, weight_decay=c.weight_decay,
                                            microbatches=c.microbatches), mesh=inp.mesh)
  iters = {d: inp.data.iterator(d, c.batch_size, salt=i, seed=seed)
           for i, d in enumerate(inp.grid.domains)}
  schedule = c.schedule
  log = inp.loops.logger(name.replace(" ", "_"))
  streams = loops.Streams(iters)
  with inp.loops.training(name, storage.join(directory, "ckpt"), trainer, total_steps=c.steps,
                          init=lambda: trainer.init(inp.policies.initial(seed)),
                          data_state=streams.state,
                          restore_data=streams.restore) as (loop, state, bar):
    log_step = functools.partial(_log_step, bar=bar, log=log, every=inp.log_every,
                                 last=c.steps - 1)
    draw = sft.SftDraw(c.effort_mode, style_weights=c.style_weights,
                       efforts=inp.grid.effort_names, view=inp.view)
    batches = sft.SftBatches(inp.tok, lambda step: next(iters[schedule[step % len(schedule)]]),
                             draw=draw, width=BatchWidth(inp.tok, inp.grid.effort_names),
                             seed=seed)
    state, history = sft.train_sft(trainer, state, batches, steps=c.steps, log=log_step,
                                   loop=loop)
  log.close()
  return state, history


def _log_step(step: int, m: dict, *, bar, log, every: int, last: int) -> None:
  """After each SFT step: the progress bar, and the metric log every `every` steps and at
  the `last`."""
  bar.update(m)
  if step % every == 0 or step == last:
    log.scalars(step, m)


@dataclasses.dataclass(frozen=True)
class BatchWidth:
  """Each SFT batch padded to its own length (one domain per update): the longest rendering
  of a prompt (an effort token or system line, or none) plus the full reference response
  (the longest style; a record's only one)."""
  tok: Any
  efforts: tuple

  def __call__(self, exs) -> int:
    def prompt_len(ex):
      return max(len(rollout.encode_prompt(self.tok, ex, e)) for e in (*self.efforts, None))
    return rollout.padded_width(max(prompt_len(ex) + len(self.tok.encode(ex.solutions["full"]))
                                    + 1 for ex in exs))
