"""Teacher bank: stacking, routing, both scoring layouts, no gradient into teachers."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.models import logprobs
from mopd_jax.teachers import bank as teachers
import toy_grid

CFG = models.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         head_dim=16, mlp_dim=64, max_seq_len=64)
# Teacher forcing, jitted (op by op, every primitive would compile on its own).
_teacher_forced = jax.jit(lambda p, t, m: logprobs.token_logprobs(CFG, p, t, input_mask=m))


@pytest.fixture(scope="module")
def bank():
  # Nine distinct teachers made cheaply: one init, each leaf scaled per teacher.
  base = models.init_params(CFG, jax.random.PRNGKey(0))
  plist = [jax.tree.map(lambda x, i=i: x * (1.0 + 0.1 * i), base) for i in range(9)]
  return teachers.build_bank(CFG, plist, names=toy_grid.NAMES, student_cfg=CFG), plist


def test_router_names(bank):
  b, _ = bank
  assert b.router.names == toy_grid.NAMES and b.num_teachers == 9
  assert b.router.index("gen", "low") == 0 and b.router.index("cod", "max") == 8
  np.testing.assert_array_equal(b.router.route(["agt", "gen"], ["high", "max"]), [4, 2])
  with pytest.raises(ValueError, match="no teacher for"):
    b.router.index("math", "low")
  assert all(x.shape[0] == 9 for x in jax.tree.leaves(b.params))


def test_any_names_allowed():
  plist = {"a/x": models.init_params(CFG, jax.random.PRNGKey(0)),
           "b/y": models.init_params(CFG, jax.random.PRNGKey(1))}
  b = teachers.build_bank(CFG, plist)
  assert b.router.index("b", "y") == 1
  with pytest.raises(ValueError, match="needs their names"):
    teachers.build_bank(CFG, list(plist.values()))


def test_vocab_mismatch_names_both_sizes():
  student = CFG.replace(vocab_size=80)
  with pytest.raises(ValueError, match="64.*80"):
    teachers.build_bank(CFG, [models.init_params(CFG, jax.random.PRNGKey(0))], names=["a/b"],
                        student_cfg=student)
  with pytest.raises(ValueError, match="family"):
    teachers.check_compatible(CFG.replace(family="llama"), CFG)


def test_shape_mismatch_is_an_error():
  other = models.init_params(CFG.replace(mlp_dim=32), jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="shape"):
    teachers.build_bank(CFG, [other], names=["a/b"])


def _batch(b=6, t=12, seed=0):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0, CFG.vocab_size)
  mask = jnp.arange(t)[None] >= jnp.arange(b)[:, None] % 3  # some left padding
  return tokens, mask


def test_routed_rows_use_their_own_teacher(bank):
  b, plist = bank
  tokens, mask = _batch()
  ids = jnp.array([0, 8, 3, 3, 5, 1])
  got = jax.jit(teachers.teacher_logprobs)(b, ids, tokens, input_mask_BxT=mask)
  for row, k in enumerate(np.asarray(ids)):
    want = _teacher_forced(plist[k], tokens[row:row + 1], mask[row:row + 1])
    np.testing.assert_allclose(got[row], want[0], atol=1e-5)


def test_stratified_equals_routed(bank):
  b, _ = bank
  tokens, mask = _batch(b=9 * 2, seed=1)
  ids = np.repeat(np.arange(9), 2)[::-1].copy()
  index = teachers.stratify(ids, 9, rows_per_teacher=3)
  tok_s = teachers.gather_stratified(np.asarray(tokens), index)
  mask_s = teachers.gather_stratified(np.asarray(mask), index, fill=False)
  strat = jax.jit(teachers.score_stratified)(b, jnp.asarray(tok_s), jnp.asarray(mask_s))
  assert strat.shape == (9, 3, 12)
  flat = teachers.scatter_stratified(strat, index, len(ids))
  routed = teachers.teacher_logprobs(b, jnp.asarray(ids), tokens, input_mask_BxT=mask)
  np.testing.assert_allclose(flat, routed, atol=1e-5)


def test_stratify_errors():
  with pytest.raises(ValueError, match="outside the bank"):
    teachers.stratify([0, 9], 9, 2)
  with pytest.raises(ValueError, match="more than rows_per_teacher"):
    teachers.stratify([1, 1, 1], 9, 2)


def test_no_gradient_flows_into_teachers(bank):
  b, _ = bank
  tokens, mask = _batch()
  ids = jnp.array([0, 1, 2, 3, 4, 5])

  def f(bank_params):
    bb = b.replace(params=bank_params)
    return jnp.sum(teachers.teacher_logprobs(bb, ids, tokens, input_mask_BxT=mask))

  g = jax.grad(f)(b.params)
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))
