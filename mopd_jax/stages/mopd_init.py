"""The mopd stage's teacher-SFT initialisation (`mopd.init=teacher_sft`): pi_SFT fine-tuned on
trajectories of every teacher, each after the student's prompt with its effort (K3 §4.1.2),
on the tokens the teachers sampled (`mopd.init_target=tokens`) or on their whole next-token
distributions (`distribution`: the forward KL on each teacher's top-k, `mopd.init_top_k`).

Each function takes the mopd stage's `Inputs` (`mopd_jax/stages/mopd.py`) as `inp`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.models import logprobs as logprobs_mod
from mopd_jax.rollout import turns as rollout
from mopd_jax.teachers import alignment, bank as teachers, families
from mopd_jax.training import registry, step as train


def teacher_sft_init(inp, student):
  """pi_SFT further fine-tuned on trajectories of every teacher, each after the student's
  prompt with its effort (K3 §4.1.2): rollouts of teacher (d, e) on training prompts (as
  the teacher sees them) at effort e's budget, kept when they finish within the cell's
  budget, then SFT on the pooled set: on the tokens the teachers sampled, or with
  `mopd.init_target=distribution` on each teacher's top-k next-token distribution
  (`teacher_targets`). Returns (params, pool size); the pool size is None when a restart
  found the init already finished."""
  total, soft = inp.cfg.init_sft_steps, inp.cfg.init_target == "distribution"
  top_k = init_top_k(inp.cfg, inp.scoring,
                     max_response_tokens=inp.teacher_engine.max_response_tokens) if soft else 0
  loss_cfg = (train.LossConfig(kind="forward_kl", args=registry.TopkArgs(top_k))
              if soft else train.LossConfig(kind="sft"))
  trainer = train.Trainer(inp.model_cfg, loss_cfg, init_optim(inp.cfg), mesh=inp.mesh)
  with inp.loops.training("mopd init: teacher SFT", inp.files.path("mopd", "init_ckpt"),
                          trainer, total_steps=total,
                          init=lambda: trainer.init(student)) as (loop, state, bar):
    if loop.start_step == total:
      return state.params, None  # finished before a restart: no need to rebuild the pool
    # Deterministic: rebuilt alike after a restart (the targets too).
    pool, targets = teacher_pool(inp, top_k=top_k)
    # One width for the whole pool: one compilation.
    width = rollout.padded_width(max(len(t.prompt_ids) + len(t.ids) for t in pool))
    for step in range(loop.start_step, total):
      # A pure function of (seed, step): a resumed init draws the same batches.
      rng = np.random.RandomState([inp.seed + 500, step])
      picked = rng.randint(len(pool), size=inp.sft.batch_size)
      rows = [pool[i] for i in picked]
      arr = rollout.pad_batch(rows, inp.tok.pad_id, width)
      extra = {}
      if soft:
        lp, ids = targets_on(arr, rows, [targets[i] for i in picked])
        extra = {"teacher_topk_logprobs": lp, "teacher_topk_ids": ids}
      state, m = trainer.step(state, train.TrainBatch.from_padded(arr, **extra))
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      loop.end_step(step, state, m, record=[step, m["loss"]])
      bar.update(m)
  return state.params, len(pool)


def init_optim(cfg: config_mod.MopdConfig) -> train.OptimConfig:
  """The teacher-SFT init's optimiser: a fine-tuning of pi_SFT at `init_lr` after
  `init_warmup_steps` of linear warmup, then cosine decay over `init_sft_steps`. At pi_SFT's
  own peak rate from the first update the toy lost a skill pi_SFT had (the `agt` copy of the
  question's name) that MOPD did not restore (docs/toy_results.md)."""
  return train.OptimConfig(lr=cfg.init_lr, warmup_steps=cfg.init_warmup_steps,
                           total_steps=cfg.init_sft_steps, microbatches=cfg.microbatches,
                           length_groups=cfg.length_groups)


# The most host memory the soft-target init's kept teacher top-k may take (log-prob and id,
# 8 bytes per kept token, at every response position of the whole pool).
INIT_TARGETS_MAX_BYTES = 4 << 30


def init_top_k(cfg: config_mod.MopdConfig, scoring: teachers.TeacherBank, *,
               max_response_tokens: int) -> int:
  """The teachers' tokens per position the soft-target init keeps (`mopd.init_top_k`; 0 or
  more than the vocabulary: the whole vocabulary). ValueError when the pool's targets
  could outgrow `INIT_TARGETS_MAX_BYTES` (a real vocabulary kept whole)."""
  vocab = scoring.model_cfg.vocab_size
  k = vocab if cfg.init_top_k <= 0 else min(cfg.init_top_k, vocab)
  most = cfg.init_samples_per_cell * scoring.num_teachers * max_response_tokens * k * 8
  if most > INIT_TARGETS_MAX_BYTES:
    raise ValueError(
        f"mopd.init_target='distribution' keeps the teachers' top-{k} at every response "
        f"position of the init's pool: up to {most / 2**30:.1f} GiB on the host for "
        f"{cfg.init_samples_per_cell} rollouts per cell of up to {max_response_tokens} "
        f"tokens (the bound is {INIT_TARGETS_MAX_BYTES / 2**30:.0f} GiB); set mopd.init_top_k "
        "to fewer tokens (0 keeps the whole vocabulary of "
        f"{vocab})")
  return k


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("top_k",))
def _teacher_topk(cfg: models.ModelConfig, params, tokens, *, input_mask, top_k: int):
  st = logprobs_mod.token_stats(cfg, params, tokens, input_mask=input_mask, top_k=top_k)
  return st.topk_logprobs, st.topk_ids


def teacher_targets(scoring: teachers.TeacherBank, k: int, trajs: list, *, pad_id: int,
                    top_k: int) -> list:
  """Teacher k's top-k next-token log-probs and ids at every response position of its own
  trajectories `trajs` (after its own prompt), at the scoring bank's temperature: per
  trajectory ([n, top_k] float32, [n, top_k] int32), n its response tokens."""
  if not trajs:
    return []
  arr = rollout.pad_batch(trajs, pad_id)
  params = jax.tree.map(lambda x: x[k], scoring.params)
  lp, ids = jax.device_get(_teacher_topk(scoring.model_cfg, params, arr["tokens"],
                                         input_mask=arr["input_mask"], top_k=top_k))
  out = []
  for i, t in enumerate(trajs):
    p = len(t.prompt_ids)
    out.append((np.asarray(lp[i, p:p + t.num_tokens], np.float32),
                np.asarray(ids[i, p:p + t.num_tokens], np.int32)))
  return out


def targets_on(arr: dict, trajs: list, targets: list) -> tuple:
  """The pool rows' teacher targets on the padded student batch `arr` of `trajs`: [B, T, k]
  log-probs and ids, each response's at its positions after the student's prompt (0 and
  id 0 elsewhere, where the loss mask is 0)."""
  b, width = arr["tokens"].shape
  k = targets[0][0].shape[-1]
  lp = np.zeros((b, width, k), np.float32)
  ids = np.zeros((b, width, k), np.int32)
  for i, (t, (tl, ti)) in enumerate(zip(trajs, targets)):
    p = len(t.prompt_ids)
    lp[i, p:p + len(tl)], ids[i, p:p + len(ti)] = tl, ti
  return lp, ids


def teacher_at(inp, k: int) -> tuple:
  """(params, sampling engine, tokenizer) of teacher k of the stage's bank (router order):
  with teachers of several families (`families.MixedBank`), its family's engine and
  tokenizer."""
  if families.is_mixed(inp.bank):
    params, _, tok = inp.bank.teacher(k)
    return params, inp.teacher_engines[inp.bank.family_of(k)], tok
  return jax.tree.map(lambda x: x[k], inp.bank.params), inp.teacher_engine, inp.teacher_tok


def teacher_pool(inp, *, top_k: int = 0) -> tuple:
  """(trajectories, targets): the teacher trajectories that finished within their cell's
  budget (each teacher samples after its own prompt, `view.teacher(e)`; the student trains
  on the response after its prompt, `view.student(e)`), and with `top_k` > 0 each one's
  teacher top-k (`teacher_targets`, at `mopd.teacher_temperature`; else None)."""
  pool, targets = [], [] if top_k else None
  for k, name in enumerate(inp.bank.router.names):
    d, e = name.split("/")
    tparams, engine, ttok = teacher_at(inp, k)
    exs = next(inp.data.iterator(d, inp.cfg.init_samples_per_cell, salt=300 + k))
    budgets = inp.budgets(exs, e)
    res = engine.run(
        tparams, exs, [inp.view.teacher(e)] * len(exs), budgets=budgets,
        rng=jax.random.PRNGKey(inp.seed + 400 + k), environment=inp.tasks[d].environment)
    # The student learns the teacher's response after its own prompt (`view.student(e)`),
    # in its own tokens.
    kept = [(t, ex) for t, ex, over in zip(res.trajectories, exs, res.over_budget)
            if not over]
    if top_k:
      targets += teacher_targets(inp.scoring, k, [t for t, _ in kept], pad_id=inp.tok.pad_id,
                                 top_k=top_k)
    for t, ex in kept:
      if ttok is not inp.tok:  # in the student's tokens (the engine counted it in them: `over`)
        try:
          ids, gen, _ = alignment.retokenize_response(ttok, inp.tok, t.ids,
                                                      gen_mask=t.gen_mask)
        except alignment.Unalignable:  # a response the student cannot write: left out
          continue
        t = dataclasses.replace(t, ids=ids, gen_mask=gen, logprobs=[0.0] * len(ids))
      pool.append(dataclasses.replace(t, prompt_ids=rollout.encode_prompt(
          inp.tok, ex, inp.view.student(e))))
  if not pool:
    raise RuntimeError("no teacher trajectory finished within its budget; cannot build the "
                       "teacher-SFT initialisation")
  return pool, targets
