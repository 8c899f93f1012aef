"""The `vocab_kl` loss (mopd_jax/training/vocab_kl.py): the exact KL to each row's routed teacher over
the whole vocabulary, on the student's rollouts, with every teacher in one program."""
import numpy as np
import pytest
from mopd_jax import configure
from mopd_jax.training import registry


def _setup(effort_free=True):
  """(student config, student, bank, sampled batch) of `mopd_batches.random_rollouts`."""
  import mopd_batches
  b = mopd_batches.random_rollouts(effort_free)
  return b.s_cfg, b.student, b.bank, b.sampled


def _batch(s_cfg, params, bank, sampled):
  """The train batch of `sampled` with its sampler log-probs and the routed teachers'."""
  import jax.numpy as jnp
  from mopd_jax.models import logprobs
  from mopd_jax.teachers import bank as teachers
  from mopd_jax.training import mopd
  arr = dict(sampled.arr)
  arr["sampler_logprobs"] = np.asarray(logprobs.token_logprobs(
      s_cfg, params, jnp.asarray(arr["tokens"]), input_mask=jnp.asarray(arr["input_mask"])))
  lp_t = np.asarray(teachers.score_stratified(bank, sampled.tokens, sampled.input_mask))
  n = arr["tokens"].shape[0]
  teacher_lp = sampled.student_layout(teachers.scatter_stratified(lp_t, sampled.index, n))
  return mopd.train_batch(arr, teacher_lp)


@pytest.mark.parametrize("effort_free,per", [(False, "row"), (True, "row"), (True, "token")])
def test_vocab_kl_loss_is_the_row_mean_of_the_exact_kl(effort_free, per):
  """The loss is the mean over rows of each row's mean exact KL over its generated tokens
  (`vocab_kl.per='row'`), or the mean over every generated token (`per='token'`), of the
  diagnostic `exact_kl_rows` (itself checked against dense logits in test_mopd.py)."""
  from mopd_jax.training import step as train, vocab_kl
  s_cfg, student, bank, sampled = _setup(effort_free)
  batch = _batch(s_cfg, student, bank, sampled)
  loss, m = vocab_kl.vocab_kl_loss(
      s_cfg, student, bank.model_cfg, teacher_params_K=bank.params,
      arrays=vocab_kl.stratified(sampled, like=student), batch=batch,
      loss_cfg=train.LossConfig(kind="vocab_kl", chunk_size=16,
                                args=registry.VocabKLArgs(per=per)))
  rows = vocab_kl.exact_kl_rows(s_cfg, student, bank, sampled=sampled, chunk_size=16)
  mask = np.asarray(sampled.arr["loss_mask"], bool)
  want = np.mean(rows.sum(1) / mask.sum(1)) if per == "row" else rows[mask].mean()
  # The two reductions differ here by about 6e-4 (relative), well beyond the rtol below.
  assert not np.isclose(np.mean(rows.sum(1) / mask.sum(1)), rows[mask].mean(), rtol=2e-4)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(m["kl_vocab"]), rows[mask].mean(), rtol=1e-5)
  assert float(m["num_rows"]) == 5 and float(m["num_tokens"]) == mask.sum()


@pytest.mark.parametrize("clip,r_max", [(False, 1e3), (True, 0.1)])
def test_vocab_kl_gradient_is_the_expected_eq15_gradient(clip, r_max):
  """At one position, eq. 15's gradient r(y) grad log pi(y) averaged over every token y
  weighted by the student's pi(y) equals the vocab_kl gradient: the loss is eq. 15's update
  with its expectation over the sampled token taken exactly; r unclipped, or with
  `vocab_kl.clip` clipped at r_max as eq. 15 clips it (0.1 binds for these two random
  models), while the loss's value stays the exact KL."""
  import jax
  import jax.numpy as jnp
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.tasks import get_task
  from mopd_jax.teachers import bank as teachers
  from mopd_jax.training import losses, mopd, step as train, vocab_kl
  tok = CharTokenizer()
  s_cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=16,
                            quant="none")
  student = models.init_params(s_cfg, jax.random.PRNGKey(3))
  bank = teachers.build_bank(s_cfg, {"gen/max": models.init_params(s_cfg,
                                                                   jax.random.PRNGKey(4))})
  ex = get_task("gen").generate(0, 1)[0]
  prompt = rollout.encode_prompt(tok, ex, "max")
  width = len(prompt) + 1
  # One row of a single generated token.
  traj = rollout.Trajectory(prompt, [tok.eos_id], [1], [0.0], True)
  arr = rollout.pad_batch([traj], tok.pad_id, width)
  t_arr, spans = mopd.teacher_view(tok, [traj], [ex], width_multiple=1)
  index = teachers.stratify(np.zeros(1, int), 1, 1)
  sampled = mopd.SampledBatch(arr=arr, index=index, tokens=jnp.asarray(t_arr["tokens"])[None],
                              input_mask=jnp.asarray(t_arr["input_mask"])[None],
                              cell_ids=np.zeros(1, int), accuracy=np.zeros(1),
                              lengths=np.ones(1), over=np.zeros(1, bool), spans=spans)
  batch = _batch(s_cfg, student, bank, sampled)
  arrays = vocab_kl.stratified(sampled, like=student)
  loss_cfg = train.LossConfig(kind="vocab_kl", r_max=r_max,
                              args=registry.VocabKLArgs(clip=clip))
  value, g_vocab = jax.value_and_grad(lambda p: vocab_kl.vocab_kl_loss(
      s_cfg, p, bank.model_cfg, teacher_params_K=bank.params, arrays=arrays, batch=batch,
      loss_cfg=loss_cfg)[0])(student)

  # Every token y at the response position: the student's and the teacher's log-probs.
  ls = jax.nn.log_softmax(models.forward(s_cfg, student, jnp.asarray(arr["tokens"]))[0, -2])
  t_params = jax.tree.map(lambda x: x[0], bank.params)
  lt = jax.nn.log_softmax(models.forward(s_cfg, t_params, jnp.asarray(t_arr["tokens"]))[0, -2])
  p_s = np.exp(np.asarray(ls))
  np.testing.assert_allclose(float(value), np.sum(p_s * (np.asarray(ls) - np.asarray(lt))),
                             rtol=1e-4)
  if clip:
    assert np.mean(np.abs(np.asarray(lt) - np.asarray(ls)) > r_max) > 0.2

  def eq15_grad(y):
    tokens = jnp.asarray(arr["tokens"]).at[0, -1].set(y)
    def loss(p):
      lp = jax.nn.log_softmax(models.forward(s_cfg, p, tokens)[0, -2])[y]
      return losses.mopd_loss(lp[None, None], lt[y][None, None], jnp.ones((1, 1), bool),
                              r_max=r_max if clip else 1e3)[0]
    return jax.grad(loss)(student)

  expected = jax.tree.map(jnp.zeros_like, student)
  for y in range(tok.vocab_size):
    expected = jax.tree.map(lambda e, g, w=p_s[y]: e + w * g, expected, eq15_grad(y))
  for a, b in zip(jax.tree.leaves(g_vocab), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=1e-6)


def test_vocab_kl_student_equal_to_teacher_gives_zero_loss_and_gradient():
  import jax
  from mopd_jax.teachers import bank as teachers
  from mopd_jax.training import step as train, vocab_kl
  s_cfg, student, _, sampled = _setup(effort_free=False)
  bank = teachers.build_bank(s_cfg, {"gen/low": student, "gen/max": student})
  batch = _batch(s_cfg, student, bank, sampled)
  arrays = vocab_kl.stratified(sampled, like=student)
  (loss, _), g = jax.value_and_grad(lambda p: vocab_kl.vocab_kl_loss(
      s_cfg, p, bank.model_cfg, teacher_params_K=bank.params, arrays=arrays, batch=batch,
      loss_cfg=train.LossConfig(kind="vocab_kl")), has_aux=True)(student)
  assert abs(float(loss)) < 1e-6
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(g)) < 1e-5


def test_vocab_kl_step_lowers_the_kl_and_keeps_teachers_out_of_the_state():
  """A few `VocabKLStep` updates lower the loss; the state holds the student only."""
  import jax
  from mopd_jax.runtime import sharding
  from mopd_jax.training import step as train, vocab_kl
  s_cfg, student, bank, sampled = _setup()
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  trainer = train.Trainer(s_cfg, train.LossConfig(kind="vocab_kl"),
                          train.OptimConfig(lr=3e-3, warmup_steps=0, total_steps=10),
                          mesh=mesh)
  state = trainer.init(student)
  step = vocab_kl.VocabKLStep.of(trainer)
  assert vocab_kl.VocabKLStep.of(trainer) is step
  losses_ = []
  for _ in range(5):
    batch = _batch(s_cfg, state.params, bank, sampled)
    state, m = step.step(state, batch, bank=bank, sampled=sampled)
    losses_.append(float(m["loss"]))
  assert losses_[-1] < 0.8 * losses_[0], losses_
  assert jax.tree.structure(state.params) == jax.tree.structure(student)


def test_future_kl_term_on_the_teachers_layout_matches_the_students_layout():
  """The loss's future-KL term, computed on the teachers' stratified layout, equals the
  term computed on the student's own layout from the exact-KL rows and the student's
  teacher-forced log-probs (rows of different lengths and shifts, the effort-free view); the
  step with the term runs and reports the mean future KL."""
  import jax
  import jax.numpy as jnp
  from mopd_jax.models import logprobs
  from mopd_jax.runtime import sharding
  from mopd_jax.training import step as train, vocab_kl
  s_cfg, student, bank, sampled = _setup(effort_free=True)
  batch = _batch(s_cfg, student, bank, sampled)
  arrays = vocab_kl.stratified(sampled, like=student)

  def loss(fk):
    return vocab_kl.vocab_kl_loss(s_cfg, student, bank.model_cfg, teacher_params_K=bank.params,
                                  arrays=arrays, batch=batch,
                                  loss_cfg=train.LossConfig(
                                      kind="vocab_kl", args=registry.VocabKLArgs(future_kl=fk)))
  (l0, _), (l1, m1) = loss(0.0), loss(1.0)
  kl = jnp.asarray(vocab_kl.exact_kl_rows(s_cfg, student, bank, sampled=sampled))
  lp = logprobs.token_logprobs(s_cfg, student, jnp.asarray(sampled.arr["tokens"]),
                               input_mask=jnp.asarray(sampled.arr["input_mask"]))
  mask = jnp.asarray(sampled.arr["loss_mask"], bool)
  want, m_want = vocab_kl.future_kl_term(kl, lp, mask)
  assert float(want) != 0.0
  np.testing.assert_allclose(float(l1) - float(l0), float(want), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(m1["future_kl_mean"]), float(m_want["future_kl_mean"]),
                             rtol=1e-4)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  lc = train.LossConfig(kind="vocab_kl", args=registry.VocabKLArgs(future_kl=1.0))
  trainer = train.Trainer(s_cfg, lc,
                          train.OptimConfig(lr=3e-3, warmup_steps=0, total_steps=2), mesh=mesh)
  state, m = vocab_kl.VocabKLStep.of(trainer).step(trainer.init(student), batch, bank=bank,
                                                   sampled=sampled)
  assert np.isfinite(float(m["loss"])) and float(m["future_kl_mean"]) > 0


def test_vocab_kl_config_rules():
  from mopd_jax.training import vocab_kl
  from configs import toy
  import dataclasses
  c = configure.build(toy.get_config("fast"), None)
  m = dataclasses.replace(c.mopd, loss="vocab_kl", length_groups=1)
  vocab_kl.check_config(m, teachers="colocated", endpoints="")
  with pytest.raises(ValueError, match="placement.teachers='colocated'"):
    vocab_kl.check_config(m, teachers="disaggregated", endpoints="")
  with pytest.raises(ValueError, match="mopd.length_groups=1"):
    vocab_kl.check_config(dataclasses.replace(m, length_groups=3), teachers="colocated",
                          endpoints="")
  with pytest.raises(ValueError, match="mopd.alpha"):
    vocab_kl.check_config(dataclasses.replace(m, alpha=0.5), teachers="colocated",
                          endpoints="")


def test_kl_logit_gradients_are_the_two_losses_gradients_in_the_logits():
  """`vocab_kl.kl_logit_gradients`: g is the gradient of KL(p || q) in p's logits and g_clip
  that of the clipped surrogate `logprobs.kl_from_hidden` differentiates with a finite
  r_max; with no token beyond the clip they are equal."""
  import jax
  import jax.numpy as jnp
  from mopd_jax.training import vocab_kl
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.normal(size=(3, 40)) * 3.0)
  lq = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 40)) * 4.0), -1)
  r_max = 2.0
  lp = jax.nn.log_softmax(z, -1)
  g, g_clip, beyond = vocab_kl.kl_logit_gradients(lp, lq, r_max=r_max)
  kl = lambda z: jnp.sum(jnp.exp(jax.nn.log_softmax(z, -1)) * (jax.nn.log_softmax(z, -1) - lq))
  np.testing.assert_allclose(g, jax.grad(kl)(z), rtol=1e-5, atol=1e-7)

  def surrogate(z):  # kl_from_hidden's clipped form: -sum_y sg(p(y) clip(r(y))) log p(y)
    l = jax.nn.log_softmax(z, -1)
    w = jax.lax.stop_gradient(jnp.exp(l) * jnp.clip(lq - l, -r_max, r_max))
    return -jnp.sum(w * l)
  np.testing.assert_allclose(g_clip, jax.grad(surrogate)(z), rtol=1e-5, atol=1e-7)
  assert 0 < np.mean(beyond) < 1
  assert not np.allclose(g, g_clip, atol=1e-4)
  _, g_wide, none = vocab_kl.kl_logit_gradients(lp, lq, r_max=1e3)
  assert not np.any(none)
  np.testing.assert_allclose(g_wide, g, rtol=1e-5, atol=1e-7)


def test_from_sft_config_takes_eq15s_clipped_expectation():
  """`configs/toy.py:from_sft` runs the `vocab_kl` loss with eq. 15's reward clip at r_max
  (docs/toy_results.md "MOPD from pi_SFT": unclipped, one of gen's high and max cells
  stalled on seeds 2 and 4); the default config, which starts from the teacher-SFT init,
  keeps the KL's own gradient."""
  from configs import toy
  fs = configure.build(toy.get_config("from_sft"), None).mopd
  assert (fs.loss, fs.init, fs.loss_args.clip, fs.r_max) == ("vocab_kl", "sft", True, 5.0)
  default = configure.build(toy.get_config(), None).mopd
  assert (default.loss, default.loss_args.clip) == ("vocab_kl", False)


def test_future_kl_term_completes_the_gradient_of_the_sequence_kl():
  """Per-position KL plus `future_kl_term`, averaged over every rollout weighted by its
  probability, has the gradient of the expected row-mean KL of a tabular two-token policy,
  found by enumerating the rollouts; the per-position KL alone misses the term through the
  first token's choice (a check that can fail: it does when the term is left out)."""
  import itertools
  import jax
  import jax.numpy as jnp
  from mopd_jax.training import vocab_kl
  rng = np.random.RandomState(0)
  v = 3
  q1 = jax.nn.log_softmax(jnp.asarray(rng.randn(v)))
  q2 = jax.nn.log_softmax(jnp.asarray(rng.randn(v, v)), -1)
  theta = {"a": jnp.asarray(rng.randn(v)), "b": jnp.asarray(rng.randn(v, v))}

  def kl(lp, lq):
    return jnp.sum(jnp.exp(lp) * (lp - lq))

  def exact(th):  # E_y [ (KL_1 + KL_2(y1)) / 2 ]
    p1, p2 = jax.nn.log_softmax(th["a"]), jax.nn.log_softmax(th["b"], -1)
    return 0.5 * (kl(p1, q1) + sum(jnp.exp(p1[y]) * kl(p2[y], q2[y]) for y in range(v)))

  def surrogate(th, with_term):
    p1, p2 = jax.nn.log_softmax(th["a"]), jax.nn.log_softmax(th["b"], -1)
    sp1, sp2 = jax.lax.stop_gradient(p1), jax.lax.stop_gradient(p2)
    total = 0.0
    for y1, y2 in itertools.product(range(v), range(v)):
      w = jnp.exp(sp1[y1] + sp2[y1, y2])
      kl_1x2 = jnp.stack([kl(p1, q1), kl(p2[y1], q2[y1])])[None]
      lp_1x2 = jnp.stack([p1[y1], p2[y1, y2]])[None]
      mask = jnp.ones((1, 2), bool)
      row = kl_1x2.mean()
      if with_term:
        row = row + vocab_kl.future_kl_term(kl_1x2, lp_1x2, mask)[0]
      total = total + w * row
    return total

  want = jax.grad(exact)(theta)
  got = jax.grad(lambda th: surrogate(th, True))(theta)
  without = jax.grad(lambda th: surrogate(th, False))(theta)
  for k in theta:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
  assert not np.allclose(without["a"], want["a"], rtol=1e-3, atol=1e-4)


def test_future_kl_baseline_keeps_the_expected_gradient_and_cancels_a_shared_cost():
  """`groups`: each row's future KL minus the mean of the other rows of its group. Two rows
  of one group drawn independently from a tabular two-token policy (every pair enumerated):
  the expected gradient equals the term's without the baseline (leave-one-out: the baseline
  does not depend on the row's own tokens); and where every rollout's continuation costs
  the same, the baselined term's gradient is 0 on every pair, while the plain term's is
  not (checks that can fail: the first does with a baseline that includes the row itself,
  which halves the term here)."""
  import itertools
  import jax
  import jax.numpy as jnp
  from mopd_jax.training import vocab_kl
  rng = np.random.RandomState(1)
  v = 3
  theta = {"a": jnp.asarray(rng.randn(v)), "b": jnp.asarray(rng.randn(v, v))}
  kl2 = jnp.asarray(rng.rand(v))  # the second position's KL after each first token

  def expected(th, groups, kl_after):
    p1, p2 = jax.nn.log_softmax(th["a"]), jax.nn.log_softmax(th["b"], -1)
    sp1, sp2 = jax.lax.stop_gradient(p1), jax.lax.stop_gradient(p2)
    rollouts = list(itertools.product(range(v), range(v)))
    total = 0.0
    for (a1, a2), (b1, b2) in itertools.product(rollouts, rollouts):
      w = jnp.exp(sp1[a1] + sp2[a1, a2] + sp1[b1] + sp2[b1, b2])
      lp = jnp.stack([jnp.stack([p1[a1], p2[a1, a2]]), jnp.stack([p1[b1], p2[b1, b2]])])
      kl = jnp.stack([jnp.stack([0.1, kl_after[a1]]), jnp.stack([0.1, kl_after[b1]])])
      total = total + w * vocab_kl.future_kl_term(kl, lp, jnp.ones((2, 2), bool),
                                                  groups=groups)[0]
    return total

  plain = jax.grad(lambda th: expected(th, 0, kl2))(theta)
  based = jax.grad(lambda th: expected(th, 1, kl2))(theta)
  for k in theta:
    np.testing.assert_allclose(based[k], plain[k], rtol=1e-5, atol=1e-7)
  lp = jnp.log(jnp.asarray([[0.2, 0.5], [0.3, 0.6]]))
  kl = jnp.asarray([[0.1, 0.7], [0.4, 0.7]])
  grad = lambda g: jax.grad(lambda x: vocab_kl.future_kl_term(
      kl, x, jnp.ones((2, 2), bool), groups=g)[0])(lp)
  np.testing.assert_allclose(grad(1), 0.0, atol=1e-7)
  assert np.abs(np.asarray(grad(0))).max() > 0.1
