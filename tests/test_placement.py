"""Teacher placement: co-located (bank on the student's mesh, split over `teacher`) and
disaggregated (bank on its own sub-mesh) give the same log-probs as unsharded scoring."""
import jax
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.teachers import bank as teachers, placement

CFG = models.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64, max_seq_len=64, qk_norm=True)
K, B, T = 4, 4, 16


@pytest.fixture(scope="module")
def bank_and_batch():
  plist = [models.init_params(CFG, jax.random.PRNGKey(k)) for k in range(K)]
  bank = teachers.build_bank(CFG, plist, names=[f"d{k}/e" for k in range(K)])
  r = np.random.RandomState(0)
  tokens = r.randint(0, CFG.vocab_size, (K, B, T)).astype(np.int32)
  mask = np.arange(T) < r.randint(6, T + 1, (K, B, 1))
  ref = np.asarray(jax.jit(teachers.score_stratified)(bank, tokens, mask))
  return bank, tokens, mask, ref


@pytest.mark.parametrize("kind,student,teacher", [
    ("colocated", dict(teacher=2, fsdp=2, tensor=2), None),
    ("disaggregated", dict(fsdp=2, tensor=2), dict(teacher=2, fsdp=2)),
])
def test_placements_equal_unsharded(bank_and_batch, kind, student, teacher):
  bank, tokens, mask, ref = bank_and_batch
  s_mesh, t_mesh = placement.make_meshes(student, teacher, kind)
  scorer = placement.TeacherScorer(bank, s_mesh, t_mesh)
  assert scorer.disaggregated == (kind == "disaggregated")
  tok = jax.device_put(tokens, placement.stratified_sharding(s_mesh, K))
  msk = jax.device_put(mask, placement.stratified_sharding(s_mesh, K))
  lp = scorer(tok, msk)
  np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-5)
  # Log-probs come back to the student's devices; the bank lives only on the teacher's.
  assert lp.sharding.device_set == set(s_mesh.devices.flat)
  bank_devices = set().union(*(x.sharding.device_set for x in jax.tree.leaves(scorer.bank)))
  assert bank_devices == set(t_mesh.devices.flat)
  if kind == "disaggregated":
    assert not bank_devices & set(s_mesh.devices.flat)
  # Each device holds 1/(teacher * fsdp) of a (teacher-stacked, embed-split) weight.
  w = scorer.bank.params["layers_0"]["mlp"]["gate_proj"]
  assert w.addressable_shards[0].data.shape[0] == K // t_mesh.shape["teacher"]


def test_make_meshes_errors():
  with pytest.raises(ValueError, match="expected one of"):
    placement.make_meshes(dict(fsdp=8), None, "nearby")
  with pytest.raises(ValueError, match="needs placement.teacher_mesh"):
    placement.make_meshes(dict(fsdp=4), None, "disaggregated")
  with pytest.raises(ValueError, match=r"!= 8 available devices"):
    placement.make_meshes(dict(fsdp=4), dict(fsdp=2), "disaggregated")
