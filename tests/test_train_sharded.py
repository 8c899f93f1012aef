"""Sharded (2x2x2 mesh of simulated CPU devices) equals single-device, for the train step,
the sampler and the teacher bank; plus train-step behaviour and bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mopd_jax import models
from mopd_jax.models import logprobs
from mopd_jax.rollout import sampling
from mopd_jax.runtime import sharding
from mopd_jax.teachers import bank as teachers
from mopd_jax.training import length_groups, losses, registry, step as train

CFG = models.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64, max_seq_len=64, qk_norm=True)
B, T = 8, 16


def _batch(seed=0):
  r = np.random.RandomState(seed)
  tokens = r.randint(0, CFG.vocab_size, (B, T)).astype(np.int32)
  prompt = r.randint(2, 6, (B, 1))
  pos = np.arange(T)[None]
  lengths = r.randint(8, T + 1, (B, 1))
  input_mask = pos < lengths
  loss_mask = input_mask & (pos >= prompt)
  return train.TrainBatch(
      tokens=jnp.asarray(tokens), input_mask=jnp.asarray(input_mask),
      loss_mask=jnp.asarray(loss_mask),
      sampler_logprobs=jnp.asarray(-r.rand(B, T).astype(np.float32) * 3),
      teacher_logprobs=jnp.asarray(-r.rand(B, T).astype(np.float32) * 3))


def _mesh(**shape):
  n = int(np.prod(list(shape.values()))) if shape else 1
  return sharding.make_mesh(shape, jax.devices()[:n])


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.PRNGKey(0))


@pytest.mark.parametrize("kind", ["mopd", pytest.param("sft", marks=pytest.mark.slow)])
def test_sharded_step_equals_single_device(params, kind):
  batch = _batch()
  results = []
  for mesh in (_mesh(), _mesh(data=2, fsdp=2, tensor=2)):
    # Adam's first steps are ~lr * sign(g): lr 1e-3 keeps a rounding-level gradient
    # difference from showing up as a 2*lr parameter difference.
    tr = train.Trainer(CFG, train.LossConfig(kind=kind), train.OptimConfig(lr=1e-3,
                                                                           warmup_steps=0),
                       mesh=mesh)
    state = tr.init(params)
    grad_fn = jax.jit(jax.grad(lambda p, b: train.compute_loss(CFG, tr.loss_cfg, p, batch=b)[0]),
                      in_shardings=(tr.state_sharding.params, train.batch_shardings(mesh, batch)))
    grads = jax.device_get(grad_fn(params, batch))
    state, m = tr.step(state, batch)
    state, m2 = tr.step(state, _batch(1))
    results.append((jax.device_get(state.params), jax.device_get(m), jax.device_get(m2), grads))
  (p1, m1, n1, g1), (p8, m8, n8, g8) = results
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
    np.testing.assert_allclose(a, b, atol=1e-5)
  for k in ("loss", "grad_norm"):
    np.testing.assert_allclose(m1[k], m8[k], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(n1[k], n8[k], atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_params_are_actually_sharded(params):
  mesh = _mesh(data=2, fsdp=2, tensor=2)
  sh = sharding.param_shardings(CFG, mesh)
  assert sh["layers_0"]["mlp"]["gate_proj"].spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  p = sharding.init_sharded_params(CFG, jax.random.PRNGKey(0), mesh)
  shard = p["layers_0"]["mlp"]["gate_proj"].addressable_shards[0].data
  assert shard.shape == (CFG.d_model // 2, CFG.mlp_dim // 2)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params)):  # same values as unsharded
    np.testing.assert_array_equal(a, b)


def test_sampled_tokens_identical_when_sharded(params):
  mesh = _mesh(data=2, fsdp=2, tensor=2)
  sp = jax.device_put(params, sharding.param_shardings(CFG, mesh))
  s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=12))
  prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]] * 2
  a = s(params, prompts, jax.random.PRNGKey(3))
  b = s(sp, prompts, jax.random.PRNGKey(3))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_teacher_axis_sharded_equals_unsharded():
  k = 4
  plist = [models.init_params(CFG, jax.random.PRNGKey(i)) for i in range(k)]
  names = [f"d{i}/e" for i in range(k)]
  ref_bank = teachers.build_bank(CFG, plist, names=names)
  mesh = _mesh(teacher=4, tensor=2)
  sh = sharding.param_shardings(CFG, mesh, num_stacked=k)
  bank = teachers.build_bank(CFG, plist, names=names, sharding=sh)
  leaf = bank.params["layers_0"]["mlp"]["up_proj"]
  assert leaf.sharding.spec[0] == "teacher"
  assert leaf.addressable_shards[0].data.shape[0] == 1  # one teacher per slice
  tokens = jax.random.randint(jax.random.PRNGKey(0), (k, 2, T), 0, CFG.vocab_size)
  mask = jnp.ones(tokens.shape, bool)
  tok_sh = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      "teacher")))
  got = jax.jit(teachers.score_stratified)(bank, tok_sh, mask)
  want = teachers.score_stratified(ref_bank, tokens, mask)
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_pg_step_matches_mopd_step_on_policy(params):
  """With sampler log-probs equal to the current ones the PG loss gives the MOPD gradient."""
  from mopd_jax.models import logprobs
  batch = _batch()
  lp = jax.jit(lambda p, b: logprobs.token_logprobs(CFG, p, b.tokens, input_mask=b.input_mask))(
      params, batch)
  batch = batch.replace(sampler_logprobs=lp)
  grads = {}
  for kind in ("mopd", "pg"):
    args = registry.RatioClip(eps_low=0.2, eps_high=0.2) if kind == "pg" else None
    lc = train.LossConfig(kind=kind, args=args)
    # Jitted: op-by-op, every primitive of the forward and backward compiles on its own.
    grads[kind] = jax.jit(jax.grad(lambda p, b: train.compute_loss(CFG, lc, p, batch=b)[0]))(
        params, batch)
  for a, b in zip(jax.tree.leaves(grads["mopd"]), jax.tree.leaves(grads["pg"])):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_nonfinite_update_is_not_applied(params):
  batch = _batch()
  bad = batch.replace(teacher_logprobs=batch.teacher_logprobs.at[0, 10].set(jnp.nan),
                      loss_mask=batch.loss_mask.at[0, 10].set(True))
  tr = train.Trainer(CFG, train.LossConfig(), train.OptimConfig(), mesh=_mesh())
  state = tr.init(params)
  new, m = tr.step(state, bad)
  assert float(m["finite"]) == 0.0 and int(new.step) == 0
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_teacher_params_not_in_train_state(params):
  tr = train.Trainer(CFG, train.LossConfig(), train.OptimConfig(), mesh=_mesh())
  state = tr.init(params)
  n_student = sum(x.size for x in jax.tree.leaves(params))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert n_opt <= 2 * n_student + 8  # Adam moments of the student only


@pytest.mark.parametrize("shape, match", [
    (dict(data=3), "3 devices but 8"), (dict(data=2, model=4), "unknown mesh axes"),
])
def test_bad_mesh(shape, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(shape)


def test_batch_not_divisible(params):
  tr = train.Trainer(CFG, train.LossConfig(), train.OptimConfig(),
                     mesh=_mesh(data=4, fsdp=2))
  batch = jax.tree.map(lambda x: x[:6], _batch())
  with pytest.raises(ValueError, match="batch size 6 is not divisible"):
    tr.step(tr.init(params), batch)


def test_bad_loss_inputs():
  with pytest.raises(ValueError, match="r_max"):
    train.LossConfig(r_max=0.0)
  with pytest.raises(ValueError, match="shape"):
    losses.mopd_loss(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)), r_max=1.0)
  with pytest.raises(ValueError, match="outside the bank"):
    teachers.check_teacher_ids([0, 12], 9)


@pytest.mark.parametrize("kind,extra", [
    ("sft", {}), ("mopd", {}), ("mopd", {"is_bounds": (0.5, 2.0)}), ("mopd", {"outcome": True}),
    # pg shares mopd's token-separable path: the slow tier's.
    pytest.param("pg", {}, marks=pytest.mark.slow), ("grpo", {"group_size": 2}),
    ("mopd", {"untied": True}), ("mopd", {"quant": "int8"}), ("sft", {"chunk_size": 5})])
def test_fused_head_loss_equals_generic(kind, extra):
  """The head fused into the loss gives the rematerialised path's loss, metrics and gradient."""
  extra = dict(extra)
  cfg = CFG.replace(tie_embeddings=not extra.pop("untied", False),
                    quant=extra.pop("quant", "none"))
  params = models.init_params(cfg, jax.random.PRNGKey(3))
  batch = _batch(2)
  if extra.pop("outcome", False):
    batch = batch.replace(advantages=jnp.asarray(np.random.RandomState(4).randn(B, T),
                                                 jnp.float32))
  if kind == "grpo":
    batch = batch.replace(rewards=jnp.asarray(np.random.RandomState(5).rand(B), jnp.float32))
  out = []
  for fused in (False, True):
    lcfg = train.LossConfig(kind=kind, fused_head=fused, **extra)
    f = jax.jit(jax.value_and_grad(lambda p: train.compute_loss(cfg, lcfg, p, batch=batch),
                                   has_aux=True))
    out.append(jax.device_get(f(params)))
  ((l0, m0), g0), ((l1, m1), g1) = out
  np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=1e-6)
  assert m0.keys() == m1.keys()
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-6, atol=1e-6, err_msg=k)
  assert jax.tree.structure(g0) == jax.tree.structure(g1)
  for path, a in jax.tree_util.tree_leaves_with_path(g0):
    b = dict(jax.tree_util.tree_leaves_with_path(g1))[path]
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _uneven_batch():
  """Rows of uneven lengths; rows 2, 4 and 6 have no loss token (prompt only) and row 5 is
  all padding, so microbatches get different numbers of non-empty rows (with 4 microbatches
  rows {2, 6} form an empty one) and the row-normalised weighting is exercised."""
  batch = _batch(3)
  loss_mask = batch.loss_mask.at[jnp.array([2, 4, 5, 6])].set(False)
  return batch.replace(input_mask=batch.input_mask.at[5].set(False), loss_mask=loss_mask,
                       rewards=jnp.asarray(np.random.RandomState(7).rand(B), jnp.float32))


@pytest.mark.parametrize("kind, extra", [
    # sft and pg weigh rows as mopd does (no groups): the slow tier's.
    ("mopd", {}), pytest.param("sft", {}, marks=pytest.mark.slow),
    pytest.param("pg", {}, marks=pytest.mark.slow), ("grpo", {"group_size": 2}),
    ("pmd", {"group_size": 2})])
def test_microbatched_step_equals_full_batch(params, kind, extra):
  """Gradient accumulation over 2 and 4 microbatches: the loss, every metric and the gradient
  of the whole batch. Plain SGD with lr 1 makes the updated params params - grad, so they
  compare the gradients themselves (Adam would turn them into ~lr * sign(g))."""
  batch = _uneven_batch()
  lcfg = train.LossConfig(kind=kind, **extra)
  opt = optax.sgd(1.0)
  state = train.init_state(params, opt)
  out = {}
  for m in (1, 2, 4):
    step = jax.jit(lambda s, b, m=m: train.train_step(CFG, lcfg, opt, state=s, batch=b,
                                                      microbatches=m))
    # LLVM at -O0: the HLO (and so the arithmetic) is unchanged, compilation is faster.
    out[m] = jax.device_get(step.lower(state, batch).compile(_FAST_COMPILE)(state, batch))
  ref_state, ref_m = out[1]
  assert float(ref_m["finite"]) == 1.0 and float(ref_m.get("num_rows", 4)) == 4.0
  for m in (2, 4):
    new_state, got = out[m]
    assert got.keys() == ref_m.keys()
    for k in ref_m:
      np.testing.assert_allclose(got[k], ref_m[k], rtol=1e-5, atol=1e-5, err_msg=f"{m} {k}")
    for path, a in jax.tree_util.tree_leaves_with_path(ref_state.params):
      b = dict(jax.tree_util.tree_leaves_with_path(new_state.params))[path]
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{m} {jax.tree_util.keystr(path)}")


def test_trainer_microbatches_on_a_sharded_mesh(params):
  """OptimConfig.microbatches reaches the Trainer's jitted step (the accumulator pinned to
  the params' shardings on an fsdp x tensor mesh): the same step as without it."""
  batch = _uneven_batch()
  mesh = _mesh(fsdp=2, tensor=2)
  results = []
  for m in (1, 4):
    tr = train.Trainer(CFG, train.LossConfig(kind="mopd"),
                       train.OptimConfig(lr=1e-3, warmup_steps=0, microbatches=m), mesh=mesh)
    state = tr.init(params)
    placed = jax.device_put(batch, train.batch_shardings(mesh, batch))
    step = tr.jitted_step(placed).lower(state, placed).compile(_FAST_COMPILE)
    state, metrics = step(state, placed)
    results.append(jax.device_get((state.params, metrics)))
  (p1, m1), (p4, m4) = results
  for k in m1:
    np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5, atol=1e-5, err_msg=k)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
    np.testing.assert_allclose(b, a, atol=1e-5)


def test_microbatch_bad_input(params):
  batch = _uneven_batch()
  with pytest.raises(ValueError, match="8 rows is not divisible into microbatches=3"):
    train.accumulate_gradients(CFG, train.LossConfig(), params, batch=batch, microbatches=3)
  with pytest.raises(ValueError, match="microbatches of 2 rows.*group_size=4"):
    train.accumulate_gradients(CFG, train.LossConfig(kind="grpo", group_size=4), params,
                               batch=batch, microbatches=4)
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
      train.OptimConfig(microbatches=bad)
  # Through the Trainer: the error comes while tracing, before anything compiles.
  tr = train.Trainer(CFG, train.LossConfig(), train.OptimConfig(microbatches=16), mesh=_mesh())
  with pytest.raises(ValueError, match="8 rows is not divisible into microbatches=16"):
    tr.step(tr.init(params), batch)


@pytest.mark.parametrize("sharded", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_reference_params_stand_in_for_the_sampler_logprobs(params, sharded):
  """`Trainer.step(..., reference=p)` (rl.reference "sft" or "parent") trains exactly like a batch whose
  `sampler_logprobs` are p's teacher-forced log-probs, on a data x fsdp mesh (the default
  tier) and on one device; with p the current params the PMD log-ratio starts at 0."""
  other = models.init_params(CFG, jax.random.PRNGKey(9))
  base = _uneven_batch()
  lcfg = train.LossConfig(kind="pmd", group_size=2, tau_kl=0.5)

  def forced(p):
    return base.replace(sampler_logprobs=logprobs.token_stats(
        CFG, p, base.tokens, input_mask=base.input_mask).logprobs)

  for mesh in ([_mesh(data=2, fsdp=2)] if sharded else [_mesh()]):
    tr = train.Trainer(CFG, lcfg, train.OptimConfig(lr=1e-3, warmup_steps=0), mesh=mesh)
    out = {}
    for name, ref, batch in (("ref_self", params, base), ("forced_self", None, forced(params)),
                             ("ref_other", other, base), ("forced_other", None, forced(other))):
      state, m = tr.step(tr.init(params), batch, reference=ref)
      out[name] = jax.device_get((state.params, m))
    assert abs(float(out["ref_self"][1]["log_ratio_mean"])) < 1e-4
    assert abs(float(out["ref_other"][1]["log_ratio_mean"])) > 1e-2
    for a, b in (("ref_self", "forced_self"), ("ref_other", "forced_other")):
      for k in out[a][1]:
        np.testing.assert_allclose(out[a][1][k], out[b][1][k], rtol=1e-5, atol=1e-5, err_msg=k)
      for x, y in zip(jax.tree.leaves(out[a][0]), jax.tree.leaves(out[b][0])):
        np.testing.assert_allclose(x, y, atol=1e-5)


def _long_tail_batch(rows=8, width=64, seed=3):
  """Rows of very different lengths inside a wide batch (most columns padding), the rows
  2 and 5 without a loss token; rewards for the group losses."""
  r = np.random.RandomState(seed)
  pos = np.arange(width)[None]
  lengths = np.array([6, 40, 9, 12, 64, 7, 30, 10][:rows])[:, None]
  input_mask = pos < lengths
  loss_mask = input_mask & (pos >= 3)
  loss_mask[[2, 5]] = False
  return train.TrainBatch(
      tokens=jnp.asarray(r.randint(0, CFG.vocab_size, (rows, width)).astype(np.int32)),
      input_mask=jnp.asarray(input_mask), loss_mask=jnp.asarray(loss_mask),
      sampler_logprobs=jnp.asarray(-r.rand(rows, width).astype(np.float32) * 3),
      teacher_logprobs=jnp.asarray(-r.rand(rows, width).astype(np.float32) * 3),
      rewards=jnp.asarray(r.rand(rows), jnp.float32))


def test_length_groups_cut_columns_and_keep_groups():
  batch = _long_tail_batch()
  groups = length_groups.split(batch, 2, multiple=16)
  assert [g.tokens.shape for g in groups] == [(4, 16), (4, 64)]
  # Every row lands in exactly one group, with its real tokens intact.
  rows = sorted(int(r) for g in groups for r in length_groups.row_lengths(g.input_mask))
  assert rows == sorted(int(x) for x in length_groups.row_lengths(batch.input_mask))
  # Group losses: a prompt's K rows stay together, ordered by their longest row.
  # Prompts (rows 0-1, 2-3, ...) longest 40, 12, 64, 30: the short group holds 2-3 and 6-7.
  g2 = length_groups.split(batch, 2, unit=2, multiple=16)
  assert [g.tokens.shape for g in g2] == [(4, 32), (4, 64)]
  np.testing.assert_array_equal(np.asarray(g2[0].rewards),
                                np.asarray(batch.rewards)[[2, 3, 6, 7]])
  # Nothing to save, rows that do not split, or a device count they do not divide: None.
  assert length_groups.split(batch, 2, multiple=64) is None
  assert length_groups.split(batch, 3) is None
  assert length_groups.split(batch, 2, row_divisor=8) is None


@pytest.mark.parametrize("kind, extra", [
    ("mopd", {}), ("pmd", {"group_size": 2}),
    pytest.param("sft", {}, marks=pytest.mark.slow),
    pytest.param("grpo", {"group_size": 2}, marks=pytest.mark.slow),
    pytest.param("pg", {}, marks=pytest.mark.slow)])
def test_length_grouped_step_equals_full_batch(params, kind, extra, monkeypatch):
  """OptimConfig.length_groups: the loss, every metric and the gradient of the whole batch
  (plain SGD with lr 1 makes the update the gradient itself), on one device and on an
  fsdp x tensor mesh, with a fixed reference for PMD."""
  monkeypatch.setattr(train, "make_optimizer", lambda cfg: optax.sgd(1.0))
  batch = _long_tail_batch()
  lcfg = train.LossConfig(kind=kind, **extra)
  ref = jax.tree.map(lambda x: x * 0.9, params) if kind == "pmd" else None
  out = {}
  for name, mesh, groups in (("whole", _mesh(), 1), ("grouped", _mesh(), 2),
                             ("grouped sharded", _mesh(fsdp=2, tensor=2), 2)):
    tr = train.Trainer(CFG, lcfg, train.OptimConfig(length_groups=groups,
                                                    group_width_multiple=16), mesh=mesh)
    state, m = tr.step(tr.init(params), batch, reference=ref)
    out[name] = jax.device_get((state.params, m))
    if groups > 1:  # the grouped programs ran, not the whole-batch one
      assert any(k[0] == "group" for k in tr._step_cache if isinstance(k, tuple))
  ref_p, ref_m = out["whole"]
  assert float(ref_m["finite"]) == 1.0
  for name in ("grouped", "grouped sharded"):
    p, m = out[name]
    assert m.keys() == ref_m.keys()
    for k in ref_m:
      np.testing.assert_allclose(m[k], ref_m[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")
    for path, a in jax.tree_util.tree_leaves_with_path(ref_p):
      b = dict(jax.tree_util.tree_leaves_with_path(p))[path]
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5,
                                 err_msg=f"{name} {jax.tree_util.keystr(path)}")


def test_length_groups_skip_a_nonfinite_step(params):
  """A NaN in one group's inputs: the update is not applied, as for the whole batch."""
  batch = _long_tail_batch()
  bad = batch.replace(teacher_logprobs=batch.teacher_logprobs.at[4, 10].set(jnp.nan))
  tr = train.Trainer(CFG, train.LossConfig(kind="mopd"),
                     train.OptimConfig(length_groups=2, group_width_multiple=16), mesh=_mesh())
  state = tr.init(params)
  new, m = tr.step(state, bad)
  assert float(m["finite"]) == 0.0 and int(new.step) == 0
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
