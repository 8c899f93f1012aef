"""The `vocab_kl` loss (mopd_jax/vocab_kl.py): the exact KL to each row's routed teacher over
the whole vocabulary, on the student's rollouts, with every teacher in one program."""
import numpy as np
import pytest


def _setup(effort_free=True):
  """(student config, student, bank, sampled batch) of `mopd_batches.random_rollouts`."""
  import mopd_batches
  b = mopd_batches.random_rollouts(effort_free)
  return b.s_cfg, b.student, b.bank, b.sampled


def _batch(s_cfg, params, bank, sampled):
  """The train batch of `sampled` with its sampler log-probs and the routed teachers'."""
  import jax.numpy as jnp
  from mopd_jax import logprobs, mopd, teachers
  arr = dict(sampled.arr)
  arr["sampler_logprobs"] = np.asarray(logprobs.token_logprobs(
      s_cfg, params, jnp.asarray(arr["tokens"]), input_mask=jnp.asarray(arr["input_mask"])))
  lp_t = np.asarray(teachers.score_stratified(bank, sampled.tokens, sampled.input_mask))
  n = arr["tokens"].shape[0]
  teacher_lp = sampled.student_layout(teachers.scatter_stratified(lp_t, sampled.index, n))
  return mopd.train_batch(arr, teacher_lp)


@pytest.mark.parametrize("effort_free", [False, True])
def test_vocab_kl_loss_is_the_row_mean_of_the_exact_kl(effort_free):
  """The loss is the mean over rows of each row's mean exact KL over its generated tokens,
  the diagnostic `exact_kl_rows` (itself checked against dense logits in test_mopd.py)."""
  from mopd_jax import vocab_kl
  s_cfg, student, bank, sampled = _setup(effort_free)
  batch = _batch(s_cfg, student, bank, sampled)
  loss, m = vocab_kl.vocab_kl_loss(
      s_cfg, student, bank.model_cfg, teacher_params_K=bank.params,
      arrays=vocab_kl.stratified(sampled, like=student), batch=batch, r_max=5.0,
      chunk_size=16)
  rows = vocab_kl.exact_kl_rows(s_cfg, student, bank, sampled=sampled, chunk_size=16)
  mask = np.asarray(sampled.arr["loss_mask"], bool)
  want = np.mean(rows.sum(1) / mask.sum(1))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(m["kl_vocab"]), rows[mask].mean(), rtol=1e-5)
  assert float(m["num_rows"]) == 5 and float(m["num_tokens"]) == mask.sum()


def test_vocab_kl_gradient_is_the_expected_eq15_gradient():
  """At one position, eq. 15's gradient r(y) grad log pi(y) (r unclipped) averaged over
  every token y weighted by the student's pi(y) equals the vocab_kl gradient: the loss is
  eq. 15's update with its expectation over the sampled token taken exactly."""
  import jax
  import jax.numpy as jnp
  from mopd_jax import losses, models, mopd, rollout, teachers, vocab_kl
  from mopd_jax.tasks import get_task
  from mopd_jax.tokenizer import CharTokenizer
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
  g_vocab = jax.grad(lambda p: vocab_kl.vocab_kl_loss(
      s_cfg, p, bank.model_cfg, teacher_params_K=bank.params, arrays=arrays, batch=batch,
      r_max=1e3)[0])(student)

  # Every token y at the response position: the student's and the teacher's log-probs.
  ls = jax.nn.log_softmax(models.forward(s_cfg, student, jnp.asarray(arr["tokens"]))[0, -2])
  t_params = jax.tree.map(lambda x: x[0], bank.params)
  lt = jax.nn.log_softmax(models.forward(s_cfg, t_params, jnp.asarray(t_arr["tokens"]))[0, -2])
  p_s = np.exp(np.asarray(ls))

  def eq15_grad(y):
    tokens = jnp.asarray(arr["tokens"]).at[0, -1].set(y)
    def loss(p):
      lp = jax.nn.log_softmax(models.forward(s_cfg, p, tokens)[0, -2])[y]
      return losses.mopd_loss(lp[None, None], lt[y][None, None], jnp.ones((1, 1), bool),
                              r_max=1e3)[0]
    return jax.grad(loss)(student)

  expected = jax.tree.map(jnp.zeros_like, student)
  for y in range(tok.vocab_size):
    expected = jax.tree.map(lambda e, g, w=p_s[y]: e + w * g, expected, eq15_grad(y))
  for a, b in zip(jax.tree.leaves(g_vocab), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=1e-6)


def test_vocab_kl_student_equal_to_teacher_gives_zero_loss_and_gradient():
  import jax
  from mopd_jax import teachers, vocab_kl
  s_cfg, student, _, sampled = _setup(effort_free=False)
  bank = teachers.build_bank(s_cfg, {"gen/low": student, "gen/max": student})
  batch = _batch(s_cfg, student, bank, sampled)
  arrays = vocab_kl.stratified(sampled, like=student)
  (loss, _), g = jax.value_and_grad(lambda p: vocab_kl.vocab_kl_loss(
      s_cfg, p, bank.model_cfg, teacher_params_K=bank.params, arrays=arrays, batch=batch,
      r_max=5.0), has_aux=True)(student)
  assert abs(float(loss)) < 1e-6
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(g)) < 1e-5


def test_vocab_kl_step_lowers_the_kl_and_keeps_teachers_out_of_the_state():
  """A few `VocabKLStep` updates lower the loss; the state holds the student only."""
  import jax
  from mopd_jax import sharding, train, vocab_kl
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


def test_vocab_kl_config_rules():
  from mopd_jax import vocab_kl
  from configs import toy
  import dataclasses
  from mopd_jax import config as config_mod
  c = config_mod.build(toy.get_config("fast"), None)
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
