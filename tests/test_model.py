"""Model: shapes, logical axes, padding invariance, cached == full forward, remat."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import models

TINY = dict(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            mlp_dim=48, max_seq_len=64)
# Jitted once per shape: op-by-op dispatch of the model compiles every primitive on its own,
# several times slower on the suite's cold cache.
_forward = jax.jit(models.forward, static_argnums=0)
_forward_with_cache = jax.jit(models.forward_with_cache, static_argnums=0)


@pytest.fixture(scope="module")
def tiny():
  cfg = models.ModelConfig(**TINY, qk_norm=True)
  return cfg, models.init_params(cfg, jax.random.PRNGKey(0))


@pytest.mark.parametrize("overrides", [
    dict(), dict(qk_norm=True), dict(tie_embeddings=False), dict(attention_bias=True),
    dict(num_kv_heads=4), dict(num_kv_heads=1),
    dict(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                       ("original_max_position_embeddings", 16), ("rope_type", "llama3"))),
])
def test_forward_shapes_and_param_count(overrides):
  cfg = models.ModelConfig(**{**TINY, **overrides})
  params = models.init_params(cfg, jax.random.PRNGKey(1))
  logits = models.forward(cfg, params, jnp.ones((2, 7), jnp.int32))
  assert logits.shape == (2, 7, cfg.vocab_size) and logits.dtype == jnp.float32
  assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
  assert np.isfinite(np.asarray(logits)).all()


def test_every_param_has_logical_axes(tiny):
  cfg, params = tiny
  axes = models.param_logical_axes(cfg)
  flat_p = jax.tree_util.tree_leaves_with_path(params)
  flat_a = jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(
      x, jax.sharding.PartitionSpec))
  assert len(flat_p) == len(flat_a)
  for (path, p), (_, spec) in zip(flat_p, flat_a):
    assert len(spec) == p.ndim and all(isinstance(a, str) for a in spec), (path, spec)


def test_causal(tiny):
  cfg, params = tiny
  t = jax.random.randint(jax.random.PRNGKey(2), (1, 10), 0, cfg.vocab_size)
  t2 = t.at[0, 6:].set(3)
  a, b = _forward(cfg, params, t), _forward(cfg, params, t2)
  np.testing.assert_allclose(a[0, :6], b[0, :6], atol=1e-6)


def test_padding_side_invariance(tiny):
  cfg, params = tiny
  row = jnp.array([5, 9, 11, 2, 7], jnp.int32)
  ref = _forward(cfg, params, row[None])[0]
  pad = jnp.zeros((3,), jnp.int32)
  left = jnp.concatenate([pad, row])[None]
  right = jnp.concatenate([row, pad])[None]
  mask_l = jnp.arange(8)[None] >= 3
  mask_r = jnp.arange(8)[None] < 5
  out_l = _forward(cfg, params, left, input_mask=mask_l)[0, 3:]
  out_r = _forward(cfg, params, right, input_mask=mask_r)[0, :5]
  np.testing.assert_allclose(out_l, ref, atol=1e-5)
  np.testing.assert_allclose(out_r, ref, atol=1e-5)


def test_cached_chunks_equal_full_forward(tiny):
  cfg, params = tiny
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, cfg.vocab_size)
  full = _forward(cfg, params, tokens)
  cache = models.init_cache(cfg, 2, 16)
  hs = []
  for lo, hi in [(0, 5), (5, 6), (6, 12)]:
    pos = jnp.broadcast_to(jnp.arange(lo, hi), (2, hi - lo))
    h, cache = _forward_with_cache(cfg, params, tokens[:, lo:hi], positions=pos,
                                   input_mask=jnp.ones((2, hi - lo), bool), cache=cache)
    hs.append(h)
  cached = models.logits_from_hidden(cfg, params, jnp.concatenate(hs, axis=1))
  np.testing.assert_allclose(cached, full, atol=1e-5)
  assert int(cache.index) == 12


def test_presets_are_real_shapes():
  q = models.get_preset("qwen3-0.6b")
  assert 0.55e9 < q.num_params() < 0.65e9, q.num_params()
  assert 1.6e9 < models.get_preset("qwen3-1.7b").num_params() < 2.1e9
  assert 7.5e9 < models.get_preset("qwen3-8b").num_params() < 8.5e9
  assert 1.1e9 < models.get_preset("llama-3.2-1b").num_params() < 1.3e9
  with pytest.raises(ValueError, match="unknown model preset"):
    models.get_preset("gpt-9")


@pytest.mark.parametrize("bad, match", [
    (dict(num_kv_heads=3), "not a multiple"), (dict(head_dim=7), "even"),
    (dict(d_model=0), "positive"), (dict(dtype="float64"), "dtype"),
])
def test_bad_config(bad, match):
  with pytest.raises(ValueError, match=match):
    models.ModelConfig(**{**TINY, **bad})


@pytest.mark.parametrize("remat", ["block", "dots"])
def test_remat_same_loss_and_gradient(tiny, remat):
  """Rematerialisation changes what the backward pass stores, never what it computes; the
  params (names, logical axes) are those of the plain model, and the cached path (sampling,
  never rematerialised) still equals the full forward."""
  cfg, params = tiny
  rcfg = cfg.replace(remat=remat)
  assert jax.tree.structure(models.init_params(rcfg, jax.random.PRNGKey(0))) == \
      jax.tree.structure(params)
  assert models.param_logical_axes(rcfg) == models.param_logical_axes(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 9), 0, cfg.vocab_size)
  mask = jnp.arange(9)[None] < jnp.array([[9], [6]])

  def loss(c, p):
    lp = jax.nn.log_softmax(models.forward(c, p, tokens, input_mask=mask))
    return jnp.mean(jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1))

  (l0, g0), (l1, g1) = (jax.jit(jax.value_and_grad(functools.partial(loss, c)))(params)
                        for c in (cfg, rcfg))
  np.testing.assert_allclose(l1, l0, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(b, a, atol=1e-6)
  cache = models.init_cache(rcfg, 2, 16)
  h, _ = _forward_with_cache(rcfg, params, tokens, positions=models.default_positions(mask),
                             input_mask=mask, cache=cache)
  np.testing.assert_allclose(models.logits_from_hidden(rcfg, params, h)[0],
                             _forward(cfg, params, tokens)[0], atol=1e-5)


def test_bad_remat():
  with pytest.raises(ValueError, match=r"remat='full'; expected one of \('none', 'block', "
                                       r"'dots'\)"):
    models.ModelConfig(**TINY, remat="full")


@pytest.mark.parametrize("tie", [True, False])
def test_decode_logits_equal_head(tiny, tie):
  """The decode-step head (embedding as the left operand when tied) is the same projection."""
  cfg = tiny[0].replace(tie_embeddings=tie, quant="int4", quant_group=16)
  params = models.init_params(cfg, jax.random.PRNGKey(1))
  h = jax.random.normal(jax.random.PRNGKey(2), (5, cfg.d_model))
  want = jax.jit(models.logits_from_hidden, static_argnums=0)(cfg, params, h)
  got = jax.jit(models.decode_logits, static_argnums=0)(cfg, params, h)
  assert got.shape == want.shape == (5, cfg.vocab_size) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_with_temperature_divides_every_logit(tiny, tie):
  """A teacher scored at temperature t: the final norm's scale over t gives logits / t
  exactly, with INT4 QAT, tied or untied, on a stacked bank too; t = 1 is the same tree."""
  cfg = tiny[0].replace(tie_embeddings=tie, quant="int4", quant_group=16)
  params = models.init_params(cfg, jax.random.PRNGKey(1))
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 9), 0, cfg.vocab_size)
  want = _forward(cfg, params, tokens) / 0.5
  got = _forward(cfg, models.with_temperature(params, 0.5), tokens)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  stacked = jax.tree.map(lambda *x: jnp.stack(x), params, params)
  assert models.with_temperature(stacked, 0.5)["final_norm"]["scale"].shape[0] == 2
  assert models.with_temperature(params, 1.0) is params
  with pytest.raises(ValueError, match="temperature"):
    models.with_temperature(params, 0.0)


def test_out_in_layout_is_the_same_model(tiny):
  """`to_out_in` (the sampler's decode layout) stores every block projection output dims
  first; the forward, cached or not, is the same model up to float rounding, and the shapes
  are those a model initialised in that layout declares."""
  cfg, params = tiny
  ocfg, oparams = models.to_out_in(cfg, params)
  assert ocfg.weight_layout == "out_in" and models.to_out_in(ocfg, oparams)[1] is oparams
  attn = oparams["layers_0"]["attn"]
  assert attn["q_proj"].shape == (cfg.num_heads, cfg.head_dim, cfg.d_model)
  assert attn["o_proj"].shape == (cfg.d_model, cfg.num_heads, cfg.head_dim)
  assert oparams["layers_0"]["mlp"]["down_proj"].shape == (cfg.d_model, cfg.mlp_dim)
  assert oparams["embed"] is params["embed"]
  declared = jax.eval_shape(lambda: models.init_params(ocfg, jax.random.PRNGKey(0)))
  assert jax.tree.map(lambda x: x.shape, declared) == jax.tree.map(lambda x: x.shape, oparams)
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 9), 0, cfg.vocab_size)
  np.testing.assert_allclose(_forward(ocfg, oparams, tokens), _forward(cfg, params, tokens),
                             atol=1e-5)
  cache = models.init_cache(cfg, 2, 16)
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  h_o, _ = _forward_with_cache(ocfg, oparams, tokens, positions=pos,
                               input_mask=jnp.ones((2, 9), bool), cache=cache)
  h_i, _ = _forward_with_cache(cfg, params, tokens, positions=pos,
                               input_mask=jnp.ones((2, 9), bool), cache=cache)
  np.testing.assert_allclose(h_o, h_i, atol=1e-5)
  with pytest.raises(ValueError, match="materialise"):
    models.to_out_in(cfg.replace(quant="int8"), params)
  with pytest.raises(ValueError, match="weight_layout"):
    cfg.replace(weight_layout="row_major")
