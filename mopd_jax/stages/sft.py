"""The sft stage: pi_SFT on every domain's mixed-style data, one domain per update (each
batch padded to its own length), QAT from here on. With `teacher.outside_cell` set, also the
outside SFT (its own seed: init, data order and effort tokens differ) under sft/outside/.
With `sft.steps=0` the initial policy (`model.hf_path`, e.g. an instruction-tuned model) is
pi_SFT as it is."""
from __future__ import annotations

import time

from mopd_jax import checkpoint, rollout, sft, storage, train
from mopd_jax.stages.context import Run


def run(ctx: Run) -> None:
  t0 = time.time()
  if ctx.config.sft.steps == 0:
    checkpoint.save_params(ctx.path("sft", "params"), ctx.initial_params())
    ctx.mark_done("sft", {"steps": 0, "final_loss": None, "seconds": time.time() - t0,
                          "loss_curve": [], "source": ctx.config.model.hf_path or "init"})
    return
  state, history = train_sft(ctx, ctx.config.seed, "sft", directory=ctx.path("sft"))
  checkpoint.save_params(ctx.path("sft", "params"), state.params)
  info = {"steps": ctx.config.sft.steps, "final_loss": history[-1][1],
          "seconds": time.time() - t0, "loss_curve": history}
  cell, seed = ctx.config.outside
  if cell:
    state, hist = train_sft(ctx, seed, "sft outside", directory=ctx.path("sft", "outside"))
    checkpoint.save_params(ctx.path("sft", "outside", "params"), state.params)
    info["outside"] = {"cell": cell, "seed": seed, "final_loss": hist[-1][1],
                       "loss_curve": hist}
  ctx.mark_done("sft", info)


def train_sft(ctx: Run, seed: int, name: str, *, directory: str):
  """One SFT run of `seed` (init, data order, batch rng), checkpointed under `directory`;
  returns (state, loss history)."""
  c = ctx.config.sft
  trainer = train.Trainer(ctx.model_cfg, train.LossConfig(kind="sft"),
                          train.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps,
                                            total_steps=c.steps, weight_decay=c.weight_decay,
                                            microbatches=c.microbatches), mesh=ctx.mesh)
  iters = {d: ctx.iterator(d, c.batch_size, salt=i, seed=seed)
           for i, d in enumerate(ctx.grid.domains)}
  schedule = c.schedule
  log = ctx.logger(name.replace(" ", "_"))

  def restore_data(data):
    for d, pos in data.items():
      iters[d].restore(pos)

  def width(exs):  # each batch padded to its own length (one domain per update)
    # The longest rendering of a prompt (an effort token or system line, or none) plus the
    # full reference response (the longest style; a record's only one).
    def prompt_len(ex):
      return max(len(rollout.encode_prompt(ctx.tok, ex, e))
                 for e in (*ctx.grid.effort_names, None))
    return rollout.padded_width(max(prompt_len(ex) + len(ctx.tok.encode(ex.solutions["full"]))
                                    + 1 for ex in exs))

  with ctx.training(name, storage.join(directory, "ckpt"), trainer, total_steps=c.steps,
                    init=lambda: trainer.init(ctx.initial_params(seed)),
                    data_state=lambda: {d: it.state() for d, it in iters.items()},
                    restore_data=restore_data) as (loop, state, bar):

    def log_step(step, m):
      bar.update(m)
      if step % ctx.config.log_every == 0 or step == c.steps - 1:
        log.scalars(step, m)

    draw = sft.SftDraw(c.effort_mode, style_weights=c.style_weights,
                       efforts=ctx.grid.effort_names, view=ctx.view)
    batches = sft.SftBatches(ctx.tok, lambda step: next(iters[schedule[step % len(schedule)]]),
                             draw=draw, width=width, seed=seed)
    state, history = sft.train_sft(trainer, state, batches, steps=c.steps, log=log_step,
                                   loop=loop)
  log.close()
  return state, history
