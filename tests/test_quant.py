"""QAT: fake-quantised forward == forward of explicitly quantised weights; export round trip."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.models import logprobs, quant

CFG = models.ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=16, mlp_dim=96, max_seq_len=64, qk_norm=True)
# Jitted once per config (op by op, every primitive would compile on its own).
_forward = jax.jit(models.forward, static_argnums=0)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.PRNGKey(0))


def _explicit_qdq(w, qmax, g, axis):
  """Reference quantise-dequantise in numpy, written independently of quant.py."""
  w = np.moveaxis(np.asarray(w, np.float64), axis, -1)
  shp = w.shape
  g = min(g, shp[-1])  # an axis shorter than a group is one group
  w = w.reshape(*shp[:-1], shp[-1] // g, g)
  s = np.abs(w).max(-1, keepdims=True) / qmax
  s[s == 0] = 1
  return np.moveaxis((np.clip(np.round(w / s), -qmax, qmax) * s).reshape(shp), -1, axis)


@pytest.mark.parametrize("mode, qmax", [("int4", 7), ("int8", 127)])
def test_qat_forward_equals_explicit_dequantised_forward(params, mode, qmax):
  cfg = CFG.replace(quant=mode, quant_group=16)
  explicit = jax.tree_util.tree_map_with_path(
      lambda path, w: w if w.ndim < 2 else jnp.asarray(_explicit_qdq(
          w, qmax, 16, -1 if path[-1].key == "embed" else 0), jnp.float32), params)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 10), 0, CFG.vocab_size)
  np.testing.assert_allclose(_forward(cfg, params, tokens),
                             _forward(CFG, explicit, tokens), atol=1e-5)
  # ... and the quantisation is not a no-op.
  assert np.abs(np.asarray(_forward(CFG, params, tokens) -
                           _forward(cfg, params, tokens))).max() > 1e-3


def test_straight_through_gradient(params):
  w = params["layers_0"]["mlp"]["up_proj"]
  g = jax.grad(lambda x: jnp.sum(quant.fake_quantize({"w": x}, "int4", 16)["w"] * 3.0))(w)
  np.testing.assert_array_equal(g, np.full(w.shape, 3.0, np.float32))


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_export_reloads_to_same_logits(params, mode):
  cfg = CFG.replace(quant=mode, quant_group=16)
  exported = quant.export(params, mode, 16)
  q = exported["['layers_0']['mlp']['up_proj']"]["q"]
  assert q.dtype == (np.uint8 if mode == "int4" else np.int8)
  if mode == "int4":  # two 4-bit values per byte
    assert q.size == params["layers_0"]["mlp"]["up_proj"].size // 2
  reloaded = quant.load_exported(exported, params)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 10), 0, CFG.vocab_size)
  np.testing.assert_allclose(_forward(CFG, reloaded, tokens),
                             _forward(cfg, params, tokens), atol=1e-5)


def test_qat_sampler_and_logprobs_agree(params):
  from mopd_jax.rollout import sampling
  cfg = CFG.replace(quant="int4", quant_group=16)
  r = sampling.Sampler(cfg, sampling.SamplingConfig(max_new_tokens=10))(
      params, [[1, 2, 3], [4]], jax.random.PRNGKey(0))
  tf = jax.jit(lambda p, t, m: logprobs.token_logprobs(cfg, p, t, input_mask=m))(
      params, r.tokens, r.input_mask)
  np.testing.assert_allclose(np.where(r.loss_mask, tf, 0), r.logprobs, atol=1e-5)


def test_bad_mode():
  with pytest.raises(ValueError, match="quant"):
    CFG.replace(quant="int3")
  with pytest.raises(ValueError, match="unknown quantisation mode"):
    quant.fake_quantize({}, "fp8")
