"""The train step under every dtype mix: param dtype x compute dtype x tied or untied head x
fused head x quantisation x loss kind. The loss and every gradient leaf are finite and each
gradient has its parameter's dtype (an optimizer update that changes a parameter's dtype, or
an assertion inside `value_and_grad`, is what a bfloat16 real-scale run would hit).

Each (param dtype, compute dtype, tie, fused) case is one jitted program computing all
quantisation x loss-kind gradients at once: one compilation per case keeps the 288-cell
matrix to seconds per case on 2 CPU cores.
"""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import memory_plan
from configs import qwen3_mopd
from mopd_jax import models
from mopd_jax.io import hf
from mopd_jax.io.tokenizer import CharTokenizer, DEFAULT_EFFORTS as EFFORTS
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import sharding
from mopd_jax.tasks import get_task
from mopd_jax.teachers import bank as teachers, placement
from mopd_jax.training import mopd, registry as loss_kinds, step as train
import toy_grid
from toy_grid import DOMAINS

DTYPES = ("float32", "bfloat16")
QUANTS = ("none", "int8", "int4")
B, T, K = 4, 12, 3


def _cfg(param_dtype, dtype, tie, quant="none"):
  return models.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=64,
                            param_dtype=param_dtype, dtype=dtype, tie_embeddings=tie,
                            qk_norm=True, quant=quant, quant_group=16)


def _batch(kind):
  r = np.random.RandomState(0)
  pos = np.arange(T)[None]
  lp = -r.rand(B, T).astype(np.float32)
  extra = {}
  if loss_kinds.LOSS_KINDS[kind].topk:  # the teacher's top-k (topk, forward_kl)
    extra = dict(teacher_topk_logprobs=jnp.asarray(-r.rand(B, T, K), jnp.float32),
                 teacher_topk_ids=jnp.asarray(r.randint(0, 64, (B, T, K)), jnp.int32))
  if loss_kinds.LOSS_KINDS[kind].needs_outcome:
    extra = dict(advantages=jnp.asarray(r.randn(B, T), jnp.float32))
  return train.TrainBatch(
      tokens=jnp.asarray(r.randint(0, 64, (B, T)), jnp.int32),
      input_mask=jnp.ones((B, T), bool), loss_mask=jnp.asarray(np.repeat(pos >= 4, B, 0)),
      sampler_logprobs=jnp.asarray(lp), teacher_logprobs=jnp.asarray(lp - 0.3),
      rewards=jnp.asarray(r.rand(B), jnp.float32), **extra)


def _teachers_in_step_loss(cfg, params, batch):
  """The vocab_kl loss of `batch` against one teacher of `cfg`, each row scored as it is."""
  from mopd_jax.training import vocab_kl
  arrays = vocab_kl.Stratified(batch.tokens, batch.input_mask, batch.tokens[None],
                               batch.input_mask[None], jnp.zeros((1, B), jnp.int32),
                               jnp.arange(B, dtype=jnp.int32)[None])
  teacher = jax.tree.map(lambda x: x[None], models.init_params(cfg, jax.random.PRNGKey(1)))
  return vocab_kl.vocab_kl_loss(cfg, params, cfg, teacher_params_K=teacher, arrays=arrays,
                                batch=batch, loss_cfg=train.LossConfig(kind="vocab_kl"))


MIXES = list(itertools.product(DTYPES, DTYPES, (True, False), (True, False)))
# The default tier runs the half fraction of the 2^4 mixes whose factors' levels sum to an
# even number: every pair of factors still meets in all four level combinations. The other
# half is the slow tier's.
_EVEN = [m for m in MIXES if sum(lv != vals[0] for lv, vals in
                                 zip(m, (DTYPES, DTYPES, (True,), (True,)))) % 2 == 0]
_ODD = [m for m in MIXES if m not in _EVEN]


@pytest.mark.parametrize("param_dtype, dtype, tie, fused",
                         _EVEN + [pytest.param(*m, marks=pytest.mark.slow) for m in _ODD])
def test_every_dtype_mix_trains(param_dtype, dtype, tie, fused):
  # Every loss kind in every mix; the quantisation modes rotate over the kinds, by a shift
  # that differs between mixes (the mix's place in its half), so that each half compiles
  # each (quant, kind) pair in at least one mix of each param dtype (6 cells per program
  # rather than 18: a third of the compile time).
  mix = (param_dtype, dtype, tie, fused)
  shift = (_EVEN if mix in _EVEN else _ODD).index(mix)
  # Every kind registered when the test runs (a loss registered outside the package too).
  kinds = tuple(loss_kinds.LOSS_KINDS)
  cells = [(QUANTS[(i + shift) % len(QUANTS)], kind) for i, kind in enumerate(kinds)]
  params = models.init_params(_cfg(param_dtype, dtype, tie), jax.random.PRNGKey(0))

  def all_cells(params):
    out = {}
    for quant, kind in cells:
      cfg = _cfg(param_dtype, dtype, tie, quant)
      args = loss_kinds.LOSS_KINDS[kind].args  # a loss with its own arguments: their defaults
      lc = train.LossConfig(kind=kind, fused_head=fused, group_size=2,
                            args=args() if args is not None else None)
      fn = lambda p: train.compute_loss(cfg, lc, p, batch=_batch(kind))
      if loss_kinds.LOSS_KINDS[kind].teachers_in_step:  # vocab_kl: one teacher in the program
        fn = lambda p, cfg=cfg, kind=kind: _teachers_in_step_loss(cfg, p, _batch(kind))
      (loss, _), grads = jax.value_and_grad(fn, has_aux=True)(params)
      out[f"{quant}/{kind}"] = (loss, grads)
    return out

  out = jax.jit(all_cells).lower(params).compile(memory_plan.COMPILER_OPTIONS)(params)
  p_leaves = jax.tree_util.tree_leaves_with_path(params)
  for name, (loss, grads) in out.items():
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss)), (name, loss)
    g_leaves = jax.tree.leaves(grads)
    assert len(g_leaves) == len(p_leaves), name
    for (path, p), g in zip(p_leaves, g_leaves):
      where = f"{name} {jax.tree_util.keystr(path)}"
      assert g.dtype == p.dtype and g.shape == p.shape, (where, g.dtype, p.dtype)
      assert np.isfinite(np.asarray(g, np.float32)).all(), where
    # The head's gradient is not identically zero (the fused backward reaches it).
    head = grads["embed"] if tie else grads["lm_head"]
    assert float(jnp.abs(head.astype(jnp.float32)).max()) > 0, name


@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_bf16_trainer_step_keeps_param_dtypes(fused):
  """The Trainer's jitted step with microbatches (the accumulator path) on bf16 params."""
  cfg = _cfg("bfloat16", "bfloat16", True, "int4")
  mesh = sharding.make_mesh({"fsdp": 2}, jax.devices()[:2])
  for micro in (1, 2):
    trainer = train.Trainer(cfg, train.LossConfig(kind="mopd", fused_head=fused),
                            train.OptimConfig(lr=1e-2, warmup_steps=0,
                                              microbatches=micro), mesh=mesh)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    state, m = trainer.step(trainer.init(params), _batch("mopd"))
    assert float(m["finite"]) == 1.0 and np.isfinite(float(m["loss"]))
    for p, q in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
      assert p.dtype == jnp.bfloat16
    assert any(float(jnp.abs(p.astype(jnp.float32) - q.astype(jnp.float32)).max()) > 0
               for p, q in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)))


def test_bf16_qwen3_mopd_step_end_to_end():
  """Student sampling, routed teacher prefill and the MOPD update of the pipeline's own MOPD
  code (`mopd.mopd_step`), on a tiny bfloat16 Qwen3-family model with int4 QAT."""
  tok = CharTokenizer()
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=256,
                           qk_norm=True, family="qwen3", param_dtype="bfloat16",
                           dtype="bfloat16", quant="int4", quant_group=8)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  student = models.init_params(cfg, jax.random.PRNGKey(0))
  bank = teachers.build_bank(cfg, [models.init_params(cfg, jax.random.PRNGKey(1 + i))
                                   for i in range(9)], names=toy_grid.NAMES)
  scorer = placement.TeacherScorer(bank, mesh, mesh)
  trainer = train.Trainer(cfg, train.LossConfig(kind="mopd"),
                          train.OptimConfig(lr=1e-2, warmup_steps=0), mesh=mesh)
  tasks = {d: get_task(d) for d in DOMAINS}
  cells = [(d, e) for d in DOMAINS for e in EFFORTS]
  per_cell = [tasks[d].generate(seed=i, n=1) for i, (d, _) in enumerate(cells)]
  engine = rollout.RolloutEngine(cfg, tok, max_response_tokens=10, max_turns=1)
  taus = {"max": 1.0, "high": 0.55, "low": 0.25}
  state, rec = mopd.mopd_step(trainer, trainer.init(student),
                              mopd.StepSetup(bank, engine, tasks, cells, taus),
                              examples_per_cell=per_cell, rng=jax.random.PRNGKey(3),
                              r_max=5.0, score_fn=lambda b, t, m: scorer(t, m))
  m = rec.metrics
  assert m["finite"] == 1.0 and np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
  assert m["kl"] != 0.0  # nine different teachers: the reward is not trivially zero
  assert set(rec.cells) == set(toy_grid.NAMES)
  for p, q in zip(jax.tree.leaves(state.params), jax.tree.leaves(student)):
    assert p.dtype == jnp.bfloat16 and p.shape == q.shape


def test_real_shape_train_step_compiles_with_bf16_params():
  """The real Qwen3-0.6B vocabulary and width (151,936 x 1,024, bfloat16, tied, int4 QAT)
  through the Trainer's jitted MOPD step, one layer deep: the smallest real-shape program in
  which a float32 head gradient for bfloat16 params fails. The full 28-layer compile is the
  slow tier's `test_memory_plan.test_real_shape_train_step_plan`."""
  c = qwen3_mopd.get_config()
  student = hf.resolve_model_config(c.model, 151_936).replace(num_layers=1)
  assert (student.vocab_size, student.d_model, student.param_dtype) == (151_936, 1024,
                                                                        "bfloat16")
  assert student.tie_embeddings and student.quant == "int4"
  mesh = sharding.make_mesh(dict(fsdp=4, tensor=2), jax.devices()[:8])
  row = memory_plan.train_program(student, mesh, 8, 32)
  assert row["temp"] > 0 and row["peak"] >= row["args"]
