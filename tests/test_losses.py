"""Tests for mopd_jax.training.losses: values, gradients, masking and validation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax.training import losses, rl_losses

B, T, V = 4, 7, 11


def _setup(seed, b=B, t=T, v=V, scale=2.0):
  """Random student/teacher logits, sampled tokens, and a ragged mask with an empty row."""
  rng = np.random.default_rng(seed)
  z_s = jnp.asarray(rng.normal(size=(b, t, v)) * scale, jnp.float32)
  z_t = jnp.asarray(rng.normal(size=(b, t, v)) * scale, jnp.float32)
  tokens = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
  mask = rng.random((b, t)) < 0.7
  mask[0] = False  # an empty row must contribute nothing
  mask[1, 0] = True  # at least one non-empty row
  return z_s, z_t, tokens, jnp.asarray(mask)


def _gather_lp(z, tokens):
  return jnp.take_along_axis(jax.nn.log_softmax(z, -1), tokens[..., None], -1)[..., 0]


def _finite(tree):
  return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree))


# ----------------------------------------------------------------------------- mopd


def test_student_equals_teacher_gives_zero_reward_loss_and_grad():
  z, _, tokens, mask = _setup(0)
  lp_t = _gather_lp(z, tokens)
  r = losses.mopd_reward(_gather_lp(z, tokens), lp_t, mask, r_max=1.0)
  np.testing.assert_array_equal(r, 0.0)
  loss_fn = lambda z_: losses.mopd_loss(_gather_lp(z_, tokens), lp_t, mask, r_max=1.0)
  (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(z)
  assert float(loss) == 0.0
  np.testing.assert_array_equal(g, 0.0)
  assert float(m["kl"]) == 0.0 and float(m["clip_frac"]) == 0.0


@pytest.mark.parametrize("seed,r_max", [(1, 10.0), (2, 0.5), (3, 0.05)])
def test_mopd_grad_matches_closed_form(seed, r_max):
  z_s, z_t, tokens, mask = _setup(seed)
  lp_t = _gather_lp(z_t, tokens)
  loss_fn = lambda z: losses.mopd_loss(_gather_lp(z, tokens), lp_t, mask, r_max=r_max)[0]
  g = jax.grad(loss_fn)(z_s)

  m = np.asarray(mask)
  lp_s = np.asarray(_gather_lp(z_s, tokens))
  r = np.where(m, np.clip(np.asarray(lp_t) - lp_s, -r_max, r_max), 0.0)
  n_tok = m.sum(1)
  n_rows = (n_tok > 0).sum()
  coef = -r / (n_rows * np.maximum(n_tok, 1))[:, None]
  onehot = np.eye(V)[np.asarray(tokens)]
  expected = coef[..., None] * (onehot - np.asarray(jax.nn.softmax(z_s, -1)))
  np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)

  loss = float(loss_fn(z_s))
  expected_loss = -np.mean([(r[i] * lp_s[i])[m[i]].mean() for i in range(B) if n_tok[i]])
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)


def test_extreme_gaps_are_clipped():
  r_max = 2.0
  lp_s = jnp.array([[-1.0, -2.0, -3.0, -0.5]])
  lp_t = lp_s + jnp.array([[1e4, -1e4, 1e4, -1e4]])
  mask = jnp.ones_like(lp_s, bool)
  r = losses.mopd_reward(lp_s, lp_t, mask, r_max=r_max)
  np.testing.assert_array_equal(r, [[r_max, -r_max, r_max, -r_max]])
  (loss, m), g = jax.value_and_grad(losses.mopd_loss, has_aux=True)(lp_s, lp_t, mask,
                                                                     r_max=r_max)
  assert _finite((loss, m, g))
  np.testing.assert_allclose(g, -r / 4)
  assert float(m["clip_frac"]) == 1.0
  assert float(m["reward_mean"]) == 0.0


def test_padding_side_and_amount_invariance():
  rng = np.random.default_rng(4)
  lengths = [3, 5, 1]
  rows = [(rng.normal(size=n) - 2, rng.normal(size=n) - 2) for n in lengths]

  def batch(t, side, extra_rows=0):
    lp_s = np.full((len(rows) + extra_rows, t), -7.0, np.float32)
    lp_t = np.full_like(lp_s, 3.0)
    mask = np.zeros(lp_s.shape, bool)
    for i, (s, te) in enumerate(rows):
      sl = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
      lp_s[i, sl], lp_t[i, sl], mask[i, sl] = s, te, True
    return jnp.asarray(lp_s), jnp.asarray(lp_t), jnp.asarray(mask)

  @jax.jit
  def all_losses(lp_s, lp_t, mask):
    loss, m = losses.mopd_loss(lp_s, lp_t, mask, r_max=1.0)
    pg, _ = rl_losses.pg_loss(lp_s, lp_s, losses.mopd_reward(lp_s, lp_t, mask, r_max=1.0),
                           loss_mask=mask)
    topk, _ = losses.topk_kl_loss(lp_s[..., None], lp_t[..., None], mask)
    return jnp.stack([loss, pg, topk, m["kl"], m["num_rows"]])

  results = [all_losses(*batch(*args))
             for args in [(5, "right"), (5, "left"), (12, "right"), (9, "left", 2)]]
  for res in results[1:]:
    np.testing.assert_allclose(res, results[0], rtol=1e-6)
  assert results[0][-1] == 3.0


def test_all_masked_batch_is_zero_with_finite_grads():
  lp_s = jnp.full((2, 3), -1.0)
  lp_t = jnp.full((2, 3), -5.0)
  mask = jnp.zeros((2, 3), bool)
  vg = jax.jit(jax.value_and_grad(losses.mopd_loss, has_aux=True), static_argnames="r_max")
  (loss, m), g = vg(lp_s, lp_t, mask, r_max=1.0)
  assert float(loss) == 0.0 and _finite((m, g))
  np.testing.assert_array_equal(g, 0.0)
  assert float(m["num_tokens"]) == 0.0 and float(m["num_rows"]) == 0.0
  (pl, pm), pg = jax.jit(jax.value_and_grad(
      lambda x: rl_losses.pg_loss(x, lp_s, lp_t, loss_mask=mask), has_aux=True))(lp_s)
  assert float(pl) == 0.0 and _finite((pm, pg))
  tl, tg = jax.jit(jax.value_and_grad(lambda x: losses.topk_kl_loss(x, x - 1, mask)[0]))(
      lp_s[..., None])
  assert float(tl) == 0.0 and _finite(tg)


def test_nonfinite_values_in_masked_positions_do_not_leak():
  z_s, z_t, tokens, mask = _setup(5)
  lp_t_clean = _gather_lp(z_t, tokens)
  poison = jnp.asarray(np.resize([np.nan, np.inf, -np.inf], (B, T)), jnp.float32)
  lp_t_bad = jnp.where(mask, lp_t_clean, poison)

  def spoil(x, bad):
    if not bad:
      return x
    keep = mask if x.ndim == 2 else mask[..., None]
    return jnp.where(keep, x, poison if x.ndim == 2 else poison[..., None])

  def mopd(z, lp_t, bad):
    return losses.mopd_loss(spoil(_gather_lp(z, tokens), bad), lp_t, mask, r_max=1.0)[0]

  def pg(z, lp_t, bad):
    lp = spoil(_gather_lp(z, tokens), bad)
    adv = losses.mopd_advantages(lp, lp_t, mask, r_max=1.0, outcome_advantage=jnp.ones(B),
                                 alpha=0.5)
    return rl_losses.pg_loss(lp, spoil(jax.lax.stop_gradient(lp) - 0.1, bad), adv, loss_mask=mask)[0]

  def topk(z, lp_t, bad):
    lp = spoil(jax.nn.log_softmax(z, -1)[..., :3], bad)
    return losses.topk_kl_loss(lp, jnp.broadcast_to(lp_t[..., None], lp.shape), mask)[0]

  for fn in (mopd, pg, topk):
    vg = jax.jit(jax.value_and_grad(fn), static_argnums=2)
    clean_l, clean_g = vg(z_s, lp_t_clean, False)
    bad_l, bad_g = vg(z_s, lp_t_bad, True)
    assert _finite((bad_l, bad_g)), fn.__name__
    np.testing.assert_array_equal(bad_l, clean_l)
    np.testing.assert_array_equal(bad_g, clean_g)


def test_jit_with_static_hyperparameters():
  z_s, z_t, tokens, mask = _setup(6)
  lp_s, lp_t = _gather_lp(z_s, tokens), _gather_lp(z_t, tokens)
  eager = losses.mopd_loss(lp_s, lp_t, mask, r_max=0.5)[0]
  jitted = jax.jit(losses.mopd_loss, static_argnames="r_max")(lp_s, lp_t, mask, r_max=0.5)[0]
  np.testing.assert_allclose(jitted, eager, rtol=1e-6)
  with pytest.raises(TypeError, match="static"):
    jax.jit(losses.mopd_loss)(lp_s, lp_t, mask, r_max=0.5)


# ----------------------------------------------------------------------------- pg


@pytest.mark.parametrize("seed,eps_low,eps_high", [(7, 0.2, 0.2), (8, 0.0, 0.0), (9, 0.1, 0.3)])
def test_pg_grad_equals_mopd_grad_on_policy(seed, eps_low, eps_high):
  z_s, z_t, tokens, mask = _setup(seed)
  lp_t = _gather_lp(z_t, tokens)

  def pg(z):
    lp = _gather_lp(z, tokens)
    adv = losses.mopd_advantages(lp, lp_t, mask, r_max=0.5)
    return rl_losses.pg_loss(lp, jax.lax.stop_gradient(lp), adv, loss_mask=mask, eps_low=eps_low,
                          eps_high=eps_high)

  (_, m), g_pg = jax.value_and_grad(pg, has_aux=True)(z_s)
  g_mopd = jax.grad(lambda z: losses.mopd_loss(_gather_lp(z, tokens), lp_t, mask,
                                               r_max=0.5)[0])(z_s)
  np.testing.assert_allclose(g_pg, g_mopd, rtol=1e-6, atol=1e-9)
  assert float(jnp.max(jnp.abs(g_pg))) > 0
  # The first step on fresh samples is exactly on-policy.
  assert float(m["ratio_mean"]) == 1.0
  assert float(m["clip_frac"]) == 0.0 and float(m["approx_kl"]) == 0.0


def test_pg_asymmetric_clipping_hand_example():
  ratio = np.array([1.5, 1.5, 0.5, 0.5, 1.1, 0.9, 1.25, 0.85], np.float32)
  adv = np.array([1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0], np.float32)
  lp_old = np.full((1, 8), -2.0, np.float32)
  lp = jnp.asarray(lp_old + np.log(ratio))
  mask = jnp.ones((1, 8), bool)

  # eps_high=0.28 > eps_low=0.2: 1.25 is inside the band, 0.5 with A<0 is clipped at 0.8.
  (loss, m), g = jax.value_and_grad(
      lambda x: rl_losses.pg_loss(x, lp_old, adv[None], loss_mask=mask, eps_low=0.2, eps_high=0.28),
      has_aux=True)(lp)
  r = np.exp(np.asarray(lp) - lp_old)[0]
  obj = np.array([1.28, -r[1], r[2], -0.8, r[4], -r[5], r[6], -r[7]])
  grad_obj = np.array([0, -r[1], r[2], 0, r[4], -r[5], r[6], -r[7]])
  np.testing.assert_allclose(loss, -obj.mean(), rtol=1e-6)
  np.testing.assert_allclose(g[0], -grad_obj / 8, rtol=1e-6)
  assert float(m["clip_frac"]) == 2 / 8

  # Symmetric 0.2 band: 1.25 with A>0 is clipped too.
  _, m_sym = rl_losses.pg_loss(lp, lp_old, adv[None], loss_mask=mask, eps_low=0.2, eps_high=0.2)
  assert float(m_sym["clip_frac"]) == 3 / 8
  # A huge log-ratio is clipped before exp.
  _, m_big = rl_losses.pg_loss(lp + 1e3, lp_old, adv[None], loss_mask=mask)
  assert _finite(m_big)


def test_mopd_advantages_outcome_term():
  lp_s = jnp.array([[-1.0, -2.0], [-3.0, -1.0]])
  lp_t = jnp.array([[-1.5, -1.0], [-3.0, -1.0]])
  mask = jnp.array([[True, True], [True, False]])
  adv = losses.mopd_advantages(lp_s, lp_t, mask, r_max=0.8,
                               outcome_advantage=jnp.array([2.0, -1.0]), alpha=0.5)
  np.testing.assert_allclose(adv, [[-0.5 + 1.0, 0.8 + 1.0], [-0.5, 0.0]])


# ----------------------------------------------------------------------------- pmd / grpo


def test_pmd_loss_matches_numpy():
  rng = np.random.default_rng(10)
  P, K, tau = 2, 3, 0.3
  new, old, r = (rng.normal(size=(P, K)).astype(np.float32) for _ in range(3))
  res = (r - r.mean(1, keepdims=True)) - tau * (new - old)
  expected = np.mean(np.mean(res**2, axis=1))
  (loss, m), g = jax.value_and_grad(rl_losses.pmd_loss, has_aux=True)(new, old, r, tau_kl=tau)
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  np.testing.assert_allclose(g, -2 * tau * res / (P * K), rtol=1e-5)
  assert _finite(m)


def test_pmd_per_token_form_and_token_clip():
  P, K, T_ = 1, 2, 3
  lp_old = np.full((P, K, T_), -1.0, np.float32)
  delta = np.array([[[0.5, -3.0, 9.0], [0.1, 0.2, 0.3]]], np.float32)
  mask = np.array([[[1, 1, 0], [1, 1, 1]]], bool)
  r = np.array([[1.0, 0.0]], np.float32)
  seq = rl_losses.sequence_logprobs(lp_old + delta, mask) - rl_losses.sequence_logprobs(lp_old, mask)
  np.testing.assert_allclose(seq, [[-2.5, 0.6]], rtol=1e-6)

  loss_unclipped, _ = rl_losses.pmd_loss(lp_old + delta, lp_old, r, tau_kl=0.5, loss_mask=mask)
  loss_seq, _ = rl_losses.pmd_loss(np.asarray(seq), np.zeros((P, K)), r, tau_kl=0.5)
  np.testing.assert_allclose(loss_unclipped, loss_seq, rtol=1e-6)

  loss, m = rl_losses.pmd_loss(lp_old + delta, lp_old, r, tau_kl=0.5, loss_mask=mask, token_clip=1.0)
  log_ratio = np.array([0.5 - 1.0, 0.6])  # -3 clipped to -1; the 9 is masked out
  res = np.array([0.5, -0.5]) - 0.5 * log_ratio
  np.testing.assert_allclose(loss, np.mean(res**2), rtol=1e-6)
  np.testing.assert_allclose(m["token_clip_frac"], 1 / 5, rtol=1e-6)


def test_grpo_advantages():
  rng = np.random.default_rng(11)
  r = rng.normal(size=(5, 4)).astype(np.float32)
  r[2] = 1.0  # constant group
  adv = np.asarray(rl_losses.grpo_advantages(r))
  assert np.all(np.isfinite(adv))
  np.testing.assert_allclose(adv.mean(1), 0.0, atol=1e-6)
  np.testing.assert_allclose(adv[2], 0.0, atol=1e-6)
  np.testing.assert_allclose(np.delete(adv, 2, 0).std(1), 1.0, rtol=1e-4)
  centred = rl_losses.grpo_advantages(r, normalize_std=False)
  np.testing.assert_allclose(centred, r - r.mean(1, keepdims=True), atol=1e-6)
  np.testing.assert_array_equal(rl_losses.grpo_advantages(np.ones((3, 1))), 0.0)


# ----------------------------------------------------------------------------- top-k


def test_topk_kl_zero_at_teacher_positive_otherwise():
  z_s, z_t, _, mask = _setup(12)
  ids = jax.lax.top_k(z_t, 4)[1]
  pick = lambda z: jnp.take_along_axis(jax.nn.log_softmax(z, -1), ids, -1)
  lp_t = pick(z_t)

  (loss, m), g = jax.value_and_grad(
      lambda z: losses.topk_kl_loss(pick(z), lp_t, mask), has_aux=True)(z_t)
  np.testing.assert_allclose(loss, 0.0, atol=1e-7)
  np.testing.assert_allclose(g, 0.0, atol=1e-7)
  np.testing.assert_allclose(m["student_topk_mass"], m["teacher_topk_mass"], rtol=1e-6)

  (loss, m), (g_s, g_t) = jax.value_and_grad(
      lambda z, lt: losses.topk_kl_loss(pick(z), lt, mask), argnums=(0, 1), has_aux=True)(
          z_s, lp_t)
  ps, pt = np.exp(np.asarray(pick(z_s))), np.exp(np.asarray(lp_t))
  per_tok = (ps * (np.log(ps) - np.log(pt)) - ps + pt).sum(-1)
  mk = np.asarray(mask)
  expected = np.mean([per_tok[i][mk[i]].mean() for i in range(B) if mk[i].any()])
  assert float(loss) > 0
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_array_equal(g_t, 0.0)  # the teacher is a constant
  assert float(jnp.max(jnp.abs(g_s))) > 0


def test_forward_kl_is_the_exact_forward_kl_over_the_vocabulary_and_its_top_k_minimum():
  """`forward_topk_kl_loss` with k = V: the token mean of KL(teacher || student), gradient
  p_s - p_t in the student's logits (per token, over the token count). With k < V its
  gradient is M p_s - p_t on the top-k (M the teacher's mass there): zero at the teacher
  renormalised on its top-k."""
  z_s, z_t, _, mask = _setup(21)
  full = lambda z: jax.nn.log_softmax(z, -1)
  ids = jax.lax.top_k(z_t, V)[1]
  pick = lambda z, ids=ids: jnp.take_along_axis(full(z), ids, -1)
  (loss, m), g = jax.value_and_grad(
      lambda z: losses.forward_topk_kl_loss(pick(z), pick(z_t), mask), has_aux=True)(z_s)
  ps, pt = np.exp(np.asarray(full(z_s))), np.exp(np.asarray(full(z_t)))
  per_tok = (pt * (np.log(pt) - np.log(ps))).sum(-1)
  mk = np.asarray(mask)
  np.testing.assert_allclose(loss, per_tok[mk].mean(), rtol=1e-5)  # a token mean
  np.testing.assert_allclose(m["teacher_topk_mass"], 1.0, rtol=1e-5)
  np.testing.assert_allclose(g, (ps - pt) * mk[..., None] / mk.sum(), atol=1e-6)
  # A teacher's top 3 only: zero gradient at the teacher renormalised on its top 3.
  ids3 = jax.lax.top_k(z_t, 3)[1]
  lp_t3 = pick(z_t, ids3)
  off = np.ones(z_t.shape, bool)
  np.put_along_axis(off, np.asarray(ids3), False, -1)
  target = np.where(off, -1e4, np.asarray(z_t))  # student logits: the top 3's alone
  g3 = jax.grad(lambda z: losses.forward_topk_kl_loss(pick(z, ids3), lp_t3, mask)[0])(
      jnp.asarray(target))
  np.testing.assert_allclose(g3, 0.0, atol=1e-6)
  g_s = jax.grad(lambda z: losses.forward_topk_kl_loss(pick(z, ids3), lp_t3, mask)[0])(z_s)
  mass = np.take_along_axis(pt, np.asarray(ids3), -1).sum(-1, keepdims=True)
  want = np.zeros_like(ps)
  sel = lambda x: np.take_along_axis(x, np.asarray(ids3), -1)
  np.put_along_axis(want, np.asarray(ids3), mass * sel(ps) - sel(pt), -1)
  want = np.where(off, mass * ps, want)  # off the top 3: M p_s
  np.testing.assert_allclose(g_s, want * mk[..., None] / mk.sum(), atol=1e-6)


# ----------------------------------------------------------------------------- validation


def test_validation_errors():
  lp = jnp.zeros((2, 3))
  mask = jnp.ones((2, 3), bool)
  for bad in (0.0, -1.0, float("nan")):
    with pytest.raises(ValueError, match=rf"r_max.*{bad}"):
      losses.mopd_loss(lp, lp, mask, r_max=bad)
  with pytest.raises(ValueError, match=r"r_max.*-0.5"):
    losses.mopd_reward(lp, lp, mask, r_max=-0.5)
  with pytest.raises(ValueError, match=r"\(2, 4\)"):
    losses.mopd_loss(lp, jnp.zeros((2, 4)), mask, r_max=1.0)
  with pytest.raises(ValueError, match=r"\(3, 3\)"):
    losses.mopd_loss(lp, lp, jnp.ones((3, 3)), r_max=1.0)
  with pytest.raises(ValueError, match="2-D"):
    losses.mopd_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)), jnp.ones((2, 3, 4)), r_max=1.0)
  with pytest.raises(ValueError, match=r"outcome_advantage.*\(3,\)"):
    losses.mopd_advantages(lp, lp, mask, r_max=1.0, outcome_advantage=jnp.zeros(3), alpha=1.0)
  with pytest.raises(ValueError, match="alpha"):
    losses.mopd_advantages(lp, lp, mask, r_max=1.0, outcome_advantage=None, alpha=1.0)

  with pytest.raises(ValueError, match=r"eps_low.*-0.1"):
    rl_losses.pg_loss(lp, lp, lp, loss_mask=mask, eps_low=-0.1)
  with pytest.raises(ValueError, match=r"eps_high.*-0.2"):
    rl_losses.pg_loss(lp, lp, lp, loss_mask=mask, eps_high=-0.2)
  with pytest.raises(ValueError, match="log_ratio_clip"):
    rl_losses.pg_loss(lp, lp, lp, loss_mask=mask, log_ratio_clip=0.0)
  with pytest.raises(ValueError, match=r"\(2, 1\)"):
    rl_losses.pg_loss(lp, lp, jnp.zeros((2, 1)), loss_mask=mask)

  with pytest.raises(ValueError, match=r"tau_kl.*0"):
    rl_losses.pmd_loss(lp, lp, lp, tau_kl=0.0)
  with pytest.raises(ValueError, match=r"\(2, 2\)"):
    rl_losses.pmd_loss(lp, lp, jnp.zeros((2, 2)), tau_kl=0.1)
  with pytest.raises(ValueError, match="token_clip"):
    rl_losses.pmd_loss(lp, lp, lp, tau_kl=0.1, token_clip=1.0)
  with pytest.raises(ValueError, match=r"token_clip.*-1"):
    rl_losses.pmd_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)), lp, tau_kl=0.1,
                    loss_mask=jnp.ones((2, 3, 4)), token_clip=-1.0)
  with pytest.raises(ValueError, match=r"rewards.*\(2,\)"):
    rl_losses.pmd_loss(jnp.zeros((2, 3, 4)), jnp.zeros((2, 3, 4)), jnp.zeros(2), tau_kl=0.1,
                    loss_mask=jnp.ones((2, 3, 4)))
  with pytest.raises(ValueError, match=r"\(2, 4\)"):
    rl_losses.sequence_logprobs(lp, jnp.ones((2, 4)))

  with pytest.raises(ValueError, match=r"eps.*-1"):
    rl_losses.grpo_advantages(lp, eps=-1e-6)
  with pytest.raises(ValueError, match=r"\(6,\)"):
    rl_losses.grpo_advantages(jnp.zeros(6))

  with pytest.raises(ValueError, match=r"loss_mask.*\(2, 4\)"):
    losses.topk_kl_loss(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 5)), jnp.ones((2, 4)))
  with pytest.raises(ValueError, match=r"\(2, 3, 6\)"):
    losses.topk_kl_loss(jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 6)), jnp.ones((2, 3)))


def test_sft_nll_is_a_token_mean():
  """Every SFT token weighs the same, however long its row: a per-row mean would favour the
  short styles (a 2-token row's tokens would count 3x a 6-token row's here)."""
  lp = jnp.asarray([[-1.0, -2.0, 0.0, 0.0, 0.0, 0.0],
                    [-3.0, -3.0, -3.0, -3.0, -3.0, -3.0]])
  mask = jnp.asarray([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
  value, m = losses.nll_loss(lp, mask)
  np.testing.assert_allclose(value, (1 + 2 + 18) / 8, rtol=1e-6)
  np.testing.assert_allclose(m["nll"], value)
  assert float(m["num_tokens"]) == 8 and float(m["num_rows"]) == 2
  g = jax.grad(lambda x: losses.nll_loss(x, mask)[0])(lp)
  np.testing.assert_allclose(g, -np.asarray(mask, np.float32) / 8)
