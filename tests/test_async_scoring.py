"""Asynchronous teacher scoring: staleness 0 is exactly the synchronous loop; staleness 1
samples batch k+1 with the params of step k and weights it with truncated importance
weights; the weights themselves."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import async_scoring as bench
from mopd_jax import models
from mopd_jax.teachers import async_scoring
from mopd_jax.training import losses

STUDENT = models.ModelConfig(vocab_size=48, d_model=32, num_layers=1, num_heads=4,
                             num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=64)
TEACHER = STUDENT.replace(num_layers=2)
STEPS = 3


def _setup(staleness):
  return bench.build(STUDENT, TEACHER, staleness=staleness, num_teachers=2,
                     rows_per_teacher=2, prompt_len=4, new_tokens=6,
                     devices=jax.devices()[:2])


def _sync_loop(state, sample, submit, train_fn):
  """The plain synchronous loop, written out: the reference for staleness 0."""
  out = []
  for step in range(STEPS):
    batch = sample(state.params, step)
    state, m = train_fn(state, batch, submit(batch))
    out.append(float(m["loss"]))
  return state, out


def _recording(sample, log):
  def wrapped(params, step):
    log.append(np.asarray(jax.device_get(params["embed"])).copy())
    return sample(params, step)
  return wrapped


def test_staleness_zero_equals_sync_exactly():  # ~45 s on 2 cores
  state, sample, submit, train_fn = _setup(0)
  fresh = jax.tree.map(jnp.copy, state)  # the step donates its state; one build compiles once
  ref_state, ref_losses = _sync_loop(state, sample, submit, train_fn)
  ref = jax.device_get(ref_state.params)
  state = fresh
  got_state, hist, times = async_scoring.run(state, STEPS, sample=sample, submit=submit,
                                             train=train_fn, staleness=0)
  assert [float(m["loss"]) for m in hist] == ref_losses
  for a, b in zip(jax.tree.leaves(jax.device_get(got_state.params)), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)
  assert times.steps == STEPS and times.sample > 0 and times.train > 0


def test_staleness_one_samples_with_previous_params():
  state, sample, submit, train_fn = _setup(1)
  used = []
  state, hist, _ = async_scoring.run(state, STEPS, sample=_recording(sample, used),
                                     submit=submit, train=train_fn, staleness=1)
  assert len(used) == STEPS
  # Batches 0 and 1 both come from the initial params; batch 2 from the params after one
  # update (one step stale), never from the params it is trained with.
  np.testing.assert_array_equal(used[0], used[1])
  assert not np.array_equal(used[1], used[2])
  for m in hist:
    assert np.isfinite(m["loss"]) and 0.5 <= m["is_weight_mean"] <= 2.0


def test_truncated_importance_weights():
  lp = jnp.log(jnp.array([[0.5, 0.2, 0.1, 0.9]]))
  old = jnp.log(jnp.array([[0.5, 0.8, 0.01, 0.9]]))
  mask = jnp.array([[True, True, True, False]])
  w = losses.truncated_importance_weights(lp, old, mask, low=0.5, high=2.0)
  np.testing.assert_allclose(w, [[1.0, 0.5, 2.0, 0.0]], rtol=1e-6)
  # On-policy (weights exactly 1) equals the unweighted loss, value and gradient.
  teacher = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
  f = lambda x, w: losses.mopd_loss(x, teacher, mask, r_max=5.0, importance_weights=w)[0]
  ones = losses.truncated_importance_weights(lp, lp, mask, low=0.5, high=2.0)
  assert f(lp, ones) == f(lp, None)
  np.testing.assert_array_equal(jax.grad(f)(lp, ones), jax.grad(f)(lp, None))
  with pytest.raises(ValueError, match="low <= 1 <= high"):
    losses.truncated_importance_weights(lp, old, mask, low=1.5, high=2.0)
  with pytest.raises(ValueError, match="staleness must be 0"):
    async_scoring.run(None, 1, sample=None, submit=None, train=None, staleness=2)
