"""Sampler exactness: cache == recompute, log-probs == teacher forcing, padding invariance."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.models import logprobs
from mopd_jax.rollout import sampling, token_draw

CFG = models.ModelConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64, max_seq_len=96, qk_norm=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15]]


@pytest.fixture(scope="module")
def params():
  # A larger init scale gives peaked distributions, so stop tokens and truncation matter.
  p = models.init_params(CFG, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


# Teacher forcing, jitted (op by op, every primitive would compile on its own).
_teacher_forced = jax.jit(lambda p, t, m: logprobs.token_logprobs(CFG, p, t, input_mask=m))


@jax.jit
def _next_greedy(params, tokens, length):
  """Full recompute (no cache) over a right-padded row; argmax after its last real token."""
  mask = jnp.arange(tokens.shape[1])[None] < length
  logits = models.forward(CFG, params, tokens, input_mask=mask)
  return jnp.argmax(logits[0, length - 1])


def _greedy_by_recompute(params, prompt, n):
  toks = np.zeros((1, len(prompt) + n), np.int32)
  toks[0, :len(prompt)] = prompt
  for i in range(len(prompt), len(prompt) + n):
    toks[0, i] = int(_next_greedy(params, toks, i))
  return toks[0, len(prompt):].tolist()


def test_greedy_cache_equals_recompute(params):
  n = 24
  r = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=n, greedy=True))(
      params, PROMPTS, jax.random.PRNGKey(0))
  p = r.tokens.shape[1] - n
  for b, prompt in enumerate(PROMPTS):
    assert list(np.asarray(r.tokens[b, p:])) == _greedy_by_recompute(params, prompt, n)
  assert np.all(np.asarray(r.logprobs) == 0.0)  # greedy samples from a point mass


def test_logprobs_equal_teacher_forcing(params):
  s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=40, stop_tokens=(3, 4)))
  r = s(params, PROMPTS, jax.random.PRNGKey(7))
  tf = _teacher_forced(params, r.tokens, r.input_mask)
  mask = np.asarray(r.loss_mask)
  assert mask.sum() > 0
  np.testing.assert_allclose(np.where(mask, tf, 0), np.asarray(r.logprobs), atol=1e-5)


def test_decode_layouts_draw_the_same_tokens(params):
  """The sampler's weight layouts (`SamplingConfig.weight_layout`; "auto" is "out_in" on this
  CPU) decode the same model: same tokens, log-probs equal up to float rounding."""
  assert sampling.decode_layout(sampling.SamplingConfig(max_new_tokens=1)) == "out_in"
  out = {}
  for layout in ("in_out", "out_in"):
    s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=24, stop_tokens=(3,),
                                                      weight_layout=layout))
    out[layout] = s(params, PROMPTS, jax.random.PRNGKey(5))
  np.testing.assert_array_equal(out["in_out"].tokens, out["out_in"].tokens)
  np.testing.assert_allclose(out["in_out"].logprobs, out["out_in"].logprobs, atol=1e-5)
  with pytest.raises(ValueError, match="weight_layout"):
    sampling.SamplingConfig(max_new_tokens=1, weight_layout="rows")


def test_sampler_with_blocked_decode_is_exact(params, monkeypatch):
  """With 8-slot cache-attention blocks (so every cache here takes the blocked path), the
  two exactness checks above hold: greedy decoding equals full recompute, and the
  sampler's log-probs equal teacher forcing."""
  from mopd_jax.models import transformer
  monkeypatch.setattr(transformer, "DECODE_BLOCK", 8)
  test_greedy_cache_equals_recompute(params)
  test_logprobs_equal_teacher_forcing(params)


def test_rollout_layout_and_stop_tokens(params):
  stops = (3, 4, 5)
  n = 40
  r = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=n, stop_tokens=stops))(
      params, PROMPTS, jax.random.PRNGKey(3))
  p = r.tokens.shape[1] - n
  assert p == 16  # smallest default bucket holding 7 tokens
  assert np.asarray(r.stopped).any(), "test needs at least one stopped row"
  for b, prompt in enumerate(PROMPTS):
    gen = np.asarray(r.tokens[b, p:])
    m = np.asarray(r.loss_mask[b, p:])
    length = int(r.lengths[b])
    assert m[:length].all() and not m[length:].any()
    assert (gen[length:] == 0).all()
    assert list(np.asarray(r.tokens[b, p - len(prompt):p])) == prompt
    assert not np.asarray(r.loss_mask[b, :p]).any()
    if bool(r.stopped[b]):
      assert gen[length - 1] in stops and not np.isin(gen[:length - 1], stops).any()
    else:
      assert length == n and not np.isin(gen, stops).any()
    lp = np.asarray(r.logprobs[b])
    assert (lp[~np.asarray(r.loss_mask[b])] == 0).all() and (lp[p:p + length] < 0).all()


def test_early_exit_when_all_rows_stop(params):
  # Every token is a stop token: each row stops after exactly one token.
  scfg = sampling.SamplingConfig(max_new_tokens=30, stop_tokens=tuple(range(CFG.vocab_size)))
  r = sampling.Sampler(CFG, scfg)(params, PROMPTS, jax.random.PRNGKey(0))
  assert np.asarray(r.lengths).tolist() == [1, 1, 1] and np.asarray(r.stopped).all()


def test_per_row_caps_cut_rows_without_changing_their_tokens(params):
  """`max_new` stops each row at its cap; the tokens before it are those of an uncapped run,
  and decoding ends when the longest cap is reached (no slot beyond it is written)."""
  s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=24))
  rng = jax.random.PRNGKey(4)
  full = s(params, PROMPTS, rng)
  caps = np.array([3, 9, 1], np.int32)
  cut = s(params, PROMPTS, rng, max_new=caps)
  assert not np.asarray(full.stopped).any()  # no stop tokens: every row runs to the end
  np.testing.assert_array_equal(np.asarray(cut.lengths), caps)
  p = full.tokens.shape[1] - 24
  for b, c in enumerate(caps):
    np.testing.assert_array_equal(cut.tokens[b, p:p + c], full.tokens[b, p:p + c])
    np.testing.assert_array_equal(cut.logprobs[b, p:p + c], full.logprobs[b, p:p + c])
    assert not np.asarray(cut.loss_mask[b, p + c:]).any()
  with pytest.raises(ValueError, match="max_new must be 3 ints"):
    s(params, PROMPTS, rng, max_new=[3, 9])
  with pytest.raises(ValueError, match=">= 1"):
    s(params, PROMPTS, rng, max_new=np.array([3, 0, 2]))


def test_same_rng_same_tokens_whatever_padding(params):
  s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=16))
  rng = jax.random.PRNGKey(11)
  ragged = s(params, PROMPTS, rng)
  width = 10
  left = np.zeros((3, width), np.int32)
  right = np.zeros((3, width), np.int32)
  for i, pr in enumerate(PROMPTS):
    left[i, width - len(pr):] = pr
    right[i, :len(pr)] = pr
  out_l = s(params, left, rng, prompt_mask=left != 0)
  out_r = s(params, right, rng, prompt_mask=right != 0)
  for o in (out_l, out_r):
    np.testing.assert_array_equal(o.tokens, ragged.tokens)
    np.testing.assert_array_equal(o.logprobs, ragged.logprobs)


def test_tokens_independent_of_bucket(params):
  """A wider bucket (more left padding) gives the same tokens."""
  rng = jax.random.PRNGKey(5)
  a = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=12, buckets=(8,)))(
      params, PROMPTS, rng)
  b = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=12, buckets=(32,)))(
      params, PROMPTS, rng)
  np.testing.assert_array_equal(a.tokens[:, 8:], b.tokens[:, 32:])
  np.testing.assert_allclose(a.logprobs[:, 8:], b.logprobs[:, 32:], atol=1e-5)


def test_one_compilation_per_bucket(params):
  s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=4, buckets=(8, 16)),
                       max_traces=2)
  for prompts in ([[1, 2]], [[1, 2, 3, 4, 5]], [[7] * 8], [[1] * 9], [[2] * 16]):
    s(params, prompts, jax.random.PRNGKey(0))
  with pytest.raises(AssertionError):  # a third shape (batch 2) would be a third trace
    s(params, [[1], [2]], jax.random.PRNGKey(0))


def _empirical(params, scfg, n_rows=2000):
  """Sample one token for many copies of a prompt; return counts and recorded log-probs."""
  r = sampling.Sampler(CFG, scfg)(params, [[9, 8, 7]] * n_rows, jax.random.PRNGKey(1))
  p = r.tokens.shape[1] - scfg.max_new_tokens
  return np.asarray(r.tokens[:, p]), np.asarray(r.logprobs[:, p])


# The last case applies all three transforms; each alone but top-p is the slow tier's.
@pytest.mark.parametrize("kw", [pytest.param(dict(temperature=0.7), marks=pytest.mark.slow),
                                pytest.param(dict(top_k=5), marks=pytest.mark.slow),
                                dict(top_p=0.8), dict(temperature=1.5, top_k=10, top_p=0.9)])
def test_logprobs_are_of_the_sampled_distribution(params, kw):
  scfg = sampling.SamplingConfig(max_new_tokens=1, **kw)
  toks, lps = _empirical(params, scfg)
  logits = models.forward(CFG, params, jnp.asarray([[9, 8, 7]]))[0, -1:]
  want = jax.nn.log_softmax(token_draw.process_logits(logits, scfg))[0]
  # The recorded log-prob of each drawn token is that of the processed distribution ...
  np.testing.assert_allclose(lps, np.asarray(want)[toks], atol=1e-5)
  # ... which puts zero mass outside the kept set, and the draws follow it.
  probs = np.exp(np.asarray(want))
  assert probs[toks].min() > 0
  freq = np.bincount(toks, minlength=CFG.vocab_size) / len(toks)
  assert np.abs(freq - probs).max() < 0.05


@pytest.mark.parametrize("kw", [dict(greedy=True), dict(temperature=0.5), dict(temperature=1.0),
                                dict(temperature=0.7, top_k=5), dict(temperature=1.5, top_p=0.8)])
def test_runtime_temperature_draws_bitwise_the_static_draw(kw):
  """`sample_token_at` with the temperature as an argument gives the tokens and the log-prob
  bits of `sample_token` with it in the static config (the continuous sampler's programs
  rely on it to serve every temperature)."""
  scfg = sampling.SamplingConfig(max_new_tokens=1, **kw)
  logits = jax.random.normal(jax.random.PRNGKey(0), (64, CFG.vocab_size)) * 3.0
  u = jax.random.uniform(jax.random.PRNGKey(1), (64,), minval=1e-7, maxval=1.0)
  want = jax.jit(lambda l, u: token_draw.sample_token(l, u, scfg))(logits, u)
  program = dataclasses.replace(scfg, temperature=1.0, greedy=False)
  got = jax.jit(lambda l, u, t: token_draw.sample_token_at(l, u, program, temperature=t))(
      logits, u, np.float32(0.0 if scfg.is_greedy else scfg.temperature))
  np.testing.assert_array_equal(np.asarray(want[0]), np.asarray(got[0]))
  np.testing.assert_array_equal(np.asarray(want[1]), np.asarray(got[1]))


def test_inverse_cdf_matches_distribution():
  probs = jnp.asarray(np.random.RandomState(0).dirichlet(np.ones(300) * 0.3, size=1)[0])
  probs = probs.at[::7].set(0.0)
  n = 20000
  u = jax.random.uniform(jax.random.PRNGKey(0), (n,), minval=1e-7)
  idx, total = token_draw.inverse_cdf(jnp.broadcast_to(probs, (n, 300)), u)
  idx = np.asarray(idx)
  np.testing.assert_allclose(np.asarray(total), float(probs.sum()), rtol=1e-6)
  assert (np.asarray(probs)[idx] > 0).all()
  freq = np.bincount(idx, minlength=300) / n
  assert np.abs(freq - np.asarray(probs) / float(probs.sum())).max() < 0.02


@pytest.mark.parametrize("prompts, kw, match", [
    ([[1] * 90], {}, "exceeds the maximum"),
    ([[1, 2], []], {}, "empty prompt"),
    ([[1, 200]], {}, "outside the vocabulary"),
    ([[1, -3]], {}, "outside the vocabulary"),
    ([], {}, "empty batch"),
    ([[1.0, 2.7]], {}, "must be integers, got 2.7"),
    ([[1.0, float("nan")]], {}, "must be integers"),
    (np.array([[1.5, 2.0]]), {}, "must be integers"),
    ([["a", "b"]], {}, "must be integers"),
    ("12+34=", {}, "got a string"),
    ([[1, 2], 7], {}, "prompt 1 must be a sequence"),
    ([[1, 2]], {"pad_id": 61}, "pad_id 61 outside the vocabulary"),
    ([[1, 2]], {"stop_tokens": (99,)}, "stop token 99 outside the vocabulary"),
])
def test_bad_prompts(params, prompts, kw, match):
  s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=8, **kw))
  with pytest.raises(ValueError, match=match):
    s(params, prompts, jax.random.PRNGKey(0))


@pytest.mark.parametrize("kw, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=-2), "max_new_tokens"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"), (dict(max_new_tokens=4, top_p=1.5), "top_p"),
    (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=4, temperature=float("nan")), "temperature must be a finite"),
    (dict(max_new_tokens=4, temperature=float("inf")), "temperature must be a finite"),
    (dict(max_new_tokens=4, top_p=float("nan")), "top_p"),
    (dict(max_new_tokens=4, top_k=2.5), "top_k must be an int"),
    (dict(max_new_tokens=4, top_k=-1), "top_k must be an int"),
    (dict(max_new_tokens=4.0), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=4, pad_id=-1), "pad_id must be an int >= 0"),
    (dict(max_new_tokens=4, pad_id=1.5), "pad_id must be an int >= 0"),
    (dict(max_new_tokens=4, greedy="yes"), "greedy"),
    (dict(max_new_tokens=4, stop_tokens=(1.5,)), "stop_tokens"),
    (dict(max_new_tokens=4, buckets=(0, 16)), "buckets"),
    (dict(max_new_tokens=4, max_prompt_len=0), "max_prompt_len"),
])
def test_bad_sampling_config(kw, match):
  with pytest.raises(ValueError, match=match):
    sampling.SamplingConfig(**kw)


@pytest.mark.parametrize("q_slots", [[0], [5], [16], [30], [36], list(range(0, 12)),
                                     list(range(20, 33))])
def test_blocked_cache_attention_equals_dense(q_slots):
  """Attention against the cache in blocks up to the last query's slot (online softmax)
  equals the dense softmax over every slot: one query (decode) or a chunk of queries
  (prefill), a ragged last block, left padding, queries early in the cache (later blocks
  never read)."""
  from mopd_jax.models import transformer
  rng = np.random.RandomState(0)
  b, kv, g, hd, s, t = 3, 2, 2, 8, 37, len(q_slots)
  qg = jnp.asarray(rng.randn(b, kv, g, t, hd), jnp.float32)
  k = jnp.asarray(rng.randn(b, kv, s, hd), jnp.float32)
  v = jnp.asarray(rng.randn(b, kv, s, hd), jnp.float32)
  valid = np.ones((b, s), bool)
  valid[1, :9] = False  # a left-padded row
  qs = np.asarray(q_slots)
  dense_mask = valid[:, None, :] & (np.arange(s)[None, :] <= qs[:, None])[None]  # [B, T, S]
  sc = jnp.einsum("bkgth,bksh->bkgts", qg, k) / np.sqrt(hd)
  sc = jnp.where(jnp.asarray(dense_mask)[:, None, None], sc, -1e30)
  want = np.asarray(jnp.einsum("bkgts,bksh->bkgth", jax.nn.softmax(sc, -1), v))
  has_key = dense_mask.any(-1)  # [B, T]: a query with no valid key is undefined
  for block in (4, 8, 16):
    got = np.asarray(transformer.decode_attention(qg, k, v, kv_mask=jnp.asarray(valid),
                                                  q_slots=jnp.asarray(qs, jnp.int32), block=block))
    for bb in range(b):
      for tt in range(t):
        if has_key[bb, tt]:
          np.testing.assert_allclose(got[bb, :, :, tt], want[bb, :, :, tt], atol=2e-6)


def test_bf16_decode_path(params):
  """`dtype="bfloat16"`: weights, activations and the KV cache in bf16; the sampler's
  log-probs stay close to fp32 teacher forcing on the same tokens (bf16 rounding only), and
  the params handed in are left as they are."""
  s = sampling.Sampler(CFG, sampling.SamplingConfig(max_new_tokens=20, dtype="bfloat16"))
  assert s.model_cfg.dtype == "bfloat16"
  r = s(params, PROMPTS, jax.random.PRNGKey(3))
  tf = _teacher_forced(params, r.tokens, r.input_mask)
  mask = np.asarray(r.loss_mask)
  diff = np.abs(np.where(mask, np.asarray(tf) - np.asarray(r.logprobs), 0)).max()
  assert 0 < diff < 0.15
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  with pytest.raises(ValueError, match="dtype must be one of"):
    sampling.SamplingConfig(max_new_tokens=4, dtype="float16")
