"""MOPD diagnostics (mopd_jax/training/diagnostics.py) against dense references on tiny random models:
the student's effort sensitivity, each cell's loss shares, and the `train_on` hook that
records them without touching the update."""
import numpy as np
import pytest

EFFORTS = ("low", "high", "max")


def _varying_tokenizer():
  """A CharTokenizer whose effort is a run of its token before the text, one more per
  effort of `EFFORTS`: each effort's prompt has its own length."""
  from mopd_jax.io.tokenizer import CharTokenizer

  class Tok(CharTokenizer):
    def encode_prompt(self, text, effort):
      ids = [self.bos_id] + self.encode(text + "\n")
      if effort is None:
        return ids
      return ids[:1] + [self.effort_id(effort)] * (EFFORTS.index(effort) + 1) + ids[1:]
  return Tok()


def _sampled(tok, efforts_of_rows, seed=0):
  """A SampledBatch of random responses (some observation tokens) after each example's
  prompt at its row's effort: one domain's cells, one per effort."""
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.tasks import get_task
  from mopd_jax.training import mopd
  rng = np.random.RandomState(seed)
  exs = get_task("gen").generate(0, len(efforts_of_rows))
  trajs = []
  for ex, e in zip(exs, efforts_of_rows):
    n = rng.randint(3, 12)
    gen = (rng.rand(n) > 0.25).astype(int).tolist()
    gen[0] = 1
    ids = rng.randint(20, 60, size=n).tolist()
    trajs.append(rollout.Trajectory(rollout.encode_prompt(tok, ex, e), ids, gen, [0.0] * n, True))
  arr = rollout.pad_batch(trajs, tok.pad_id, 64)
  cells = tuple(("gen", e) for e in EFFORTS)
  return mopd.SampledBatch(
      arr=arr, index=None, tokens=None, input_mask=None,
      cell_ids=np.asarray([EFFORTS.index(e) for e in efforts_of_rows]),
      accuracy=np.zeros(len(exs)), lengths=np.asarray([t.num_tokens for t in trajs]),
      over=np.zeros(len(exs), bool), examples=exs), trajs, cells


@pytest.mark.parametrize("varying", [False, True])
def test_effort_kl_equals_the_dense_kl_between_neighbouring_efforts(varying):
  """Along each rollout, KL(pi(.|e_a) || pi(.|e_b)) of every response token's prediction
  equals sum_v p_a (log p_a - log p_b) from dense [T, V] logits of the sequences rendered
  with e_a and e_b, on the generated tokens (0 on observations); with efforts of differing
  prompt lengths too. The per-cell and overall means are token means of those values."""
  import jax
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.training import diagnostics
  tok = _varying_tokenizer() if varying else CharTokenizer()
  cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=32)
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  sampled, trajs, cells = _sampled(tok, ["low", "max", "high", "max", "low"])
  got, gen = diagnostics.effort_kl_rows(cfg, params, sampled, tok=tok, cells=cells,
                                        efforts=EFFORTS, chunk_size=8)
  assert got.shape[:2] == (2, 5) and gen.shape == got.shape[1:]

  fwd = jax.jit(lambda p, t: jax.nn.log_softmax(models.forward(cfg, p, t[None])[0], -1))
  want = np.zeros_like(got)
  for b, (t, ex) in enumerate(zip(trajs, sampled.examples)):
    lps, starts = [], []
    for e in EFFORTS:
      prompt = rollout.encode_prompt(tok, ex, e)
      lps.append(np.asarray(fwd(params, np.asarray(prompt + t.ids, np.int32))))
      starts.append(len(prompt))
    assert len(set(starts)) == (3 if varying else 1)
    for p, (a, c) in enumerate(((0, 1), (1, 2))):
      for j in range(t.num_tokens):  # response token j, predicted at start + j - 1
        la, lc = lps[a][starts[a] + j - 1], lps[c][starts[c] + j - 1]
        want[p, b, j] = np.sum(np.exp(la) * (la - lc)) if t.gen_mask[j] else 0.0
      np.testing.assert_array_equal(gen[b, :t.num_tokens], np.asarray(t.gen_mask, bool))
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6)
  assert np.all(got[:, ~gen] == 0) and np.all(got[:, gen] > 0)

  overall, per_cell = diagnostics.effort_sensitivity(cfg, params, sampled, tok=tok,
                                                     cells=cells, efforts=EFFORTS, chunk_size=8)
  keys = ["effort_kl/low-high", "effort_kl/high-max"]
  assert list(overall) == keys and set(per_cell) == {"gen/low", "gen/high", "gen/max"}
  for p, k in enumerate(keys):
    assert overall[k] == pytest.approx(want[p][gen].mean(), rel=1e-4)
    rows = np.asarray([0, 4])  # gen/low's rollouts
    assert per_cell["gen/low"][k] == pytest.approx(want[p][rows][gen[rows]].mean(), rel=1e-4)
  # A row whose prompt is not its example's at its cell's effort is refused.
  sampled.cell_ids = np.asarray([1, 2, 1, 2, 0])
  with pytest.raises(ValueError, match="row 0"):
    diagnostics.effort_kl_rows(cfg, params, sampled, tok=tok, cells=cells, efforts=EFFORTS)


def _batch(cfg, seed=0):
  import jax.numpy as jnp
  from mopd_jax.training import step as train
  r = np.random.RandomState(seed)
  b, t = 6, 16
  pos = np.arange(t)[None]
  input_mask = pos < r.randint(8, t + 1, (b, 1))
  loss_mask = input_mask & (pos >= 3)
  loss_mask[5] = False  # an empty row (pads a batch to its fixed size)
  return train.TrainBatch(
      tokens=jnp.asarray(r.randint(0, cfg.vocab_size, (b, t)).astype(np.int32)),
      input_mask=jnp.asarray(input_mask), loss_mask=jnp.asarray(loss_mask),
      sampler_logprobs=jnp.asarray(-r.rand(b, t).astype(np.float32) * 4),
      teacher_logprobs=jnp.asarray(-r.rand(b, t).astype(np.float32) * 6),
      advantages=jnp.asarray(r.randn(b, 1).astype(np.float32) * loss_mask))


ROWS = {"gen/low": np.asarray([0, 3]), "gen/high": np.asarray([1, 4, 5]),
        "gen/max": np.asarray([2])}


def test_loss_shares_equal_dense_per_cell_gradients():
  """Per cell: the gradient norm of the explicitly written MOPD loss over that cell's rows
  with the whole batch's normalisation, -(1/N) sum_i (1/|y_i|) sum_t r_t log pi(y_t) and
  -(1/M) sum_i sum_t r_t log pi(y_t), from dense [B, T, V] logits and `jax.grad`; the token
  and per-sequence weight shares by count. The whole batch's per-sequence norm is the
  trainer's loss's."""
  import jax
  import jax.numpy as jnp
  import optax
  from mopd_jax import models
  from mopd_jax.models import logprobs
  from mopd_jax.training import diagnostics, step as train
  cfg = models.ModelConfig(vocab_size=48, d_model=32, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=64)
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  batch = _batch(cfg).replace(advantages=None)
  loss_cfg = train.LossConfig(kind="mopd", r_max=1.0)  # some rewards clipped
  overall, cells = diagnostics.loss_shares(cfg, loss_cfg, params, batch=batch,
                                           rows_of_cell=ROWS)

  mask = np.asarray(batch.loss_mask, np.float32)
  n_i = mask.sum(-1)
  n_rows, m_tok = float((n_i > 0).sum()), n_i.sum()

  def dense_loss(p, w_B, per_seq):
    lp = logprobs.full_token_logprobs(cfg, p, batch.tokens, input_mask=batch.input_mask)
    r = jnp.clip(jax.lax.stop_gradient(batch.teacher_logprobs - lp), -1.0, 1.0) * mask
    tok_sum = jnp.sum(r * lp * mask, -1)
    per_row = tok_sum / jnp.maximum(n_i, 1) / n_rows if per_seq else tok_sum / m_tok
    return -jnp.sum(w_B * per_row)

  grad_norm = jax.jit(lambda p, w, per_seq: optax.tree.norm(jax.grad(dense_loss)(p, w, per_seq)),
                      static_argnums=2)
  seq, tok = {}, {}
  for name, rows in ROWS.items():
    w = np.zeros(6, np.float32)
    w[rows] = 1.0
    seq[name], tok[name] = float(grad_norm(params, w, True)), float(grad_norm(params, w, False))
    c = cells[name]
    assert c["grad_norm_seq"] == pytest.approx(seq[name], rel=1e-4)
    assert c["grad_norm_tok"] == pytest.approx(tok[name], rel=1e-4)
    assert c["token_share"] == pytest.approx(n_i[rows].sum() / m_tok)
    assert c["seq_weight_share"] == pytest.approx((n_i[rows] > 0).sum() / n_rows)
  for name in ROWS:
    assert cells[name]["grad_share_seq"] == pytest.approx(seq[name] / sum(seq.values()), 1e-4)
    assert cells[name]["grad_share_tok"] == pytest.approx(tok[name] / sum(tok.values()), 1e-4)
  ones = np.ones(6, np.float32)
  assert overall["grad_norm_seq"] == pytest.approx(float(grad_norm(params, ones, True)), 1e-4)
  assert overall["grad_norm_tok"] == pytest.approx(float(grad_norm(params, ones, False)), 1e-4)
  trainer_grad = jax.grad(lambda p: train.compute_loss(cfg, loss_cfg, p, batch=batch)[0])(params)
  assert overall["grad_norm_seq"] == pytest.approx(float(optax.tree.norm(trainer_grad)), 1e-4)
  assert cells["gen/high"]["seq_weight_share"] == pytest.approx(2 / 5)  # row 5 holds no token


def test_loss_shares_follow_the_trainers_loss_with_its_options():
  """With importance weights and the outcome term (the pg kind), a cell's per-sequence
  gradient is the trainer's loss on a batch holding only that cell's loss tokens, scaled by
  the cell's share of the rows (N_k / N); the cells' gradients sum to the batch's. Losses
  that are not row-normalised are refused."""
  import jax
  import optax
  from mopd_jax import models
  from mopd_jax.training import diagnostics, step as train
  cfg = models.ModelConfig(vocab_size=48, d_model=32, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=64)
  params = models.init_params(cfg, jax.random.PRNGKey(1))
  batch = _batch(cfg, seed=1)
  loss_cfg = train.LossConfig(kind="pg", r_max=2.0)
  _, cells = diagnostics.loss_shares(cfg, loss_cfg, params, batch=batch, rows_of_cell=ROWS)
  grad = jax.jit(jax.grad(lambda p, b: train.compute_loss(cfg, loss_cfg, p, batch=b)[0]))
  n_i = np.asarray(batch.loss_mask).sum(-1)
  total = None
  for name, rows in ROWS.items():
    keep = np.zeros((6, 1), bool)
    keep[rows] = True
    g = grad(params, batch.replace(loss_mask=batch.loss_mask & keep))
    g = jax.tree.map(lambda x: x * (n_i[rows] > 0).sum() / (n_i > 0).sum(), g)
    assert cells[name]["grad_norm_seq"] == pytest.approx(float(optax.tree.norm(g)), rel=1e-4)
    total = g if total is None else jax.tree.map(lambda a, b: a + b, total, g)
  want = optax.tree.norm(jax.tree.map(lambda a, b: a - b, total, grad(params, batch)))
  assert float(want) < 1e-5 * float(optax.tree.norm(total))
  with pytest.raises(ValueError, match="row-normalised"):
    diagnostics.loss_shares(cfg, train.LossConfig(kind="grpo"), params, batch=batch,
                            rows_of_cell=ROWS)


def test_train_on_records_the_measured_diagnostics_and_updates_alike():
  """`train_on`'s `measure` hook: the step's update is bitwise the one without it, and the
  record gains the effort sensitivity overall and per cell, the exact KL and the shares."""
  import jax
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.runtime import sharding
  from mopd_jax.tasks import get_task
  from mopd_jax.teachers import bank as teachers, placement
  from mopd_jax.training import diagnostics, mopd, step as train, vocab_kl
  tok = CharTokenizer()
  cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=32)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  cells = tuple(("gen", e) for e in EFFORTS)
  names = tuple(f"gen/{e}" for e in EFFORTS)
  bank = teachers.build_bank(cfg, [models.init_params(cfg, jax.random.PRNGKey(1 + i))
                                   for i in range(3)], names=names)
  scorer = placement.TeacherScorer(bank, mesh, mesh)
  loss_cfg = train.LossConfig(kind="mopd")
  trainer = train.Trainer(cfg, loss_cfg, train.OptimConfig(lr=1e-2, warmup_steps=0), mesh=mesh)
  task = get_task("gen")
  per_cell = [task.generate(seed=i, n=2) for i in range(3)]
  engine = rollout.RolloutEngine(cfg, tok, max_response_tokens=8, max_turns=1)
  setup = mopd.StepSetup(bank, engine, {"gen": task}, list(cells),
                         {"low": 0.3, "high": 0.7, "max": 1.5})
  sampled = mopd.sample_batch(setup, params, per_cell, rng=jax.random.PRNGKey(3))
  scored = scorer(sampled.tokens, sampled.input_mask)
  probe = diagnostics.Probe(cfg, loss_cfg, tok, cells, EFFORTS)

  def measure(p, s, b):
    kl = vocab_kl.exact_kl_rows(cfg, p, bank, sampled=s)
    return diagnostics.merge(diagnostics.exact_kl_means(kl, s, names), probe.measure(p, s, b))

  plain, rec0 = mopd.train_on(trainer, trainer.init(params), bank, sampled=sampled, scored=scored,
                              r_max=5.0)
  measured, rec = mopd.train_on(trainer, trainer.init(params), bank, sampled=sampled, scored=scored,
                                r_max=5.0, measure=measure)
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(measured.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert {k: v for k, v in rec.metrics.items() if k in rec0.metrics} == rec0.metrics
  assert set(rec.metrics) - set(rec0.metrics) == {
      "kl_exact", "effort_kl/low-high", "effort_kl/high-max", "grad_norm_seq", "grad_norm_tok"}
  assert rec.metrics["grad_norm_seq"] == pytest.approx(rec0.metrics["grad_norm"], rel=1e-3)
  for name in names:
    assert {"kl_exact", "effort_kl/low-high", "effort_kl/high-max", *diagnostics.SHARE_KEYS,
            *diagnostics.GRAD_NORM_KEYS} <= set(rec.cells[name])
  assert sum(rec.cells[n]["token_share"] for n in names) == pytest.approx(1.0)
  assert sum(rec.cells[n]["grad_share_seq"] for n in names) == pytest.approx(1.0)
