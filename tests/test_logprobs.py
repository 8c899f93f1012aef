"""Chunked token log-probs equal the full log_softmax gather; gradients agree too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.models import logprobs

CFG = models.ModelConfig(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64, max_seq_len=128)


@pytest.fixture(scope="module")
def setup():
  params = models.init_params(CFG, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 37), 0, CFG.vocab_size)
  mask = jnp.arange(37)[None] >= jnp.array([[0], [5], [11]])  # left padding of 0, 5, 11
  return params, tokens, mask


@pytest.mark.parametrize("chunk", [1, 8, 36, 64])
def test_chunked_equals_full(setup, chunk):
  params, tokens, mask = setup
  got = logprobs.token_logprobs(CFG, params, tokens, input_mask=mask, chunk_size=chunk)
  want = logprobs.full_token_logprobs(CFG, params, tokens, input_mask=mask)
  assert got.shape == tokens.shape
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert np.all(np.asarray(got[:, 0]) == 0)


def test_entropy_and_topk(setup):
  params, tokens, mask = setup
  st = logprobs.token_stats(CFG, params, tokens, input_mask=mask, chunk_size=8,
                            with_entropy=True, top_k=5)
  logits = models.forward(CFG, params, tokens, input_mask=mask)[:, :-1]
  lsm = jax.nn.log_softmax(logits, axis=-1)
  ent = -jnp.sum(jnp.exp(lsm) * lsm, axis=-1)
  np.testing.assert_allclose(st.entropy[:, 1:], ent, atol=1e-5)
  vals, ids = jax.lax.top_k(lsm, 5)
  np.testing.assert_allclose(st.topk_logprobs[:, 1:], vals, atol=1e-6)
  np.testing.assert_array_equal(st.topk_ids[:, 1:], ids)
  # Scoring on another model's support: gathering at given ids.
  other = logprobs.token_stats(CFG, params, tokens, input_mask=mask, chunk_size=8, top_k=5,
                               topk_ids_BxTxK=st.topk_ids)
  np.testing.assert_allclose(other.topk_logprobs, st.topk_logprobs, atol=1e-6)


def test_rank_of_the_given_token(setup):
  """`with_rank`: 1 + how many tokens the model finds likelier than the given one (vLLM's
  `rank`), chunked like the log-probs; the log-probs themselves unchanged."""
  params, tokens, mask = setup
  st = logprobs.token_stats(CFG, params, tokens, input_mask=mask, chunk_size=8, with_rank=True)
  lsm = np.asarray(jax.nn.log_softmax(models.forward(CFG, params, tokens, input_mask=mask)[:, :-1],
                                      axis=-1))
  given = np.take_along_axis(lsm, np.asarray(tokens)[:, 1:, None], axis=-1)
  np.testing.assert_array_equal(st.rank[:, 1:], 1 + (lsm > given).sum(-1))
  assert st.rank.dtype == jnp.int32 and not np.asarray(st.rank[:, 0]).any()
  np.testing.assert_array_equal(st.logprobs, logprobs.token_stats(
      CFG, params, tokens, input_mask=mask, chunk_size=8).logprobs)


def test_gradients_match_full(setup):
  params, tokens, mask = setup
  w = jax.random.normal(jax.random.PRNGKey(2), tokens.shape)

  def loss(fn, p):
    return jnp.sum(jnp.where(mask, fn(p) * w, 0.0))

  g_chunk = jax.jit(jax.grad(lambda p: loss(lambda q: logprobs.token_logprobs(
      CFG, q, tokens, input_mask=mask, chunk_size=8), p)))(params)
  g_full = jax.jit(jax.grad(lambda p: loss(lambda q: logprobs.full_token_logprobs(
      CFG, q, tokens, input_mask=mask), p)))(params)
  for a, b in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_never_materialises_full_logits():
  """The compiled vocabulary projection's temp memory stays far below one [B, T, V] buffer."""
  cfg = CFG.replace(vocab_size=4096)
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.PRNGKey(0)))
  hidden = jax.ShapeDtypeStruct((4, 256, cfg.d_model), jnp.float32)
  tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)
  full_bytes = 4 * 256 * 4096 * 4

  def full_from_hidden(p, h, t):
    lsm = jax.nn.log_softmax(models.logits_from_hidden(cfg, p, h), axis=-1)
    return jnp.take_along_axis(lsm, t[..., None], axis=-1)[..., 0]

  def temp(fn):
    return jax.jit(fn).lower(params, hidden, tokens).compile().memory_analysis().temp_size_in_bytes

  chunked = temp(lambda p, h, t: logprobs.token_stats_from_hidden(
      cfg, p, h, tokens_BxT=t, options=logprobs.StatsOptions(chunk_size=16)).logprobs)
  full = temp(full_from_hidden)
  assert full >= full_bytes
  assert chunked < full_bytes / 8, (chunked, full)
