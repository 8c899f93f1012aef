"""The RL lane's pieces (mopd_jax/rl.py, mopd_jax/lanes.py): phase settings, batch widths,
the plateau rule, lane process counts."""
import pytest


def test_rl_phase_settings():
  import ml_collections
  from mopd_jax import rl
  c = ml_collections.ConfigDict(dict(reference="sampler,sft,parent", lr=1e-3, tau_kl=0.5,
                                     anneal_lr=0.0, anneal_tau_kl=0.1, steps_per_effort=20,
                                     anneal_steps=30))
  order = ("max", "high", "low")
  assert [rl.phase_settings(c, e, order) for e in order] == [
      dict(reference="sampler", lr=1e-3, tau_kl=0.5, steps=20),
      dict(reference="sft", lr=1e-3, tau_kl=0.1, steps=30),
      dict(reference="parent", lr=1e-3, tau_kl=0.1, steps=30)]
  assert rl.references("sft", order) == dict(max="sft", high="sft", low="sft")
  # Two values: the first phase, then every budget phase, for any number of phases.
  assert rl.references("sampler,sft", order) == dict(max="sampler", high="sft", low="sft")
  assert rl.references("sampler,sft", ("a", "b")) == dict(a="sampler", b="sft")
  assert rl.references("sampler,sft", ("only",)) == dict(only="sampler")
  assert rl.references("sampler,sft,parent,sft", "abcd") == dict(a="sampler", b="sft",
                                                                 c="parent", d="sft")
  for bad in ("phase", "sampler,sft,sft,sft", "sampler,,sft"):
    with pytest.raises(ValueError, match="rl.reference"):
      rl.references(bad, order)


def test_padding_rule_of_each_loop():
  """rollout.padded_width: RL's powers of two above the floor, SFT's multiples of 16,
  MOPD's of 32."""
  from mopd_jax import rollout
  w = rollout.padded_width
  assert [w(n, pow2=True, floor=64) for n in (1, 40, 64, 65, 93, 128, 129)] == \
      [64, 64, 64, 128, 128, 128, 256]
  assert w(20, pow2=True, floor=16) == 32
  assert [w(n) for n in (1, 16, 17, 40)] == [16, 16, 32, 48]
  assert [w(n, 32) for n in (1, 32, 33)] == [32, 32, 64]


def test_rl_lane_processes():
  import ml_collections
  from mopd_jax import lanes
  c = lambda k: ml_collections.ConfigDict(dict(lane_processes=k))
  assert lanes.process_count(c(3), 3) == 3
  assert lanes.process_count(c(8), 4) == 4  # never more processes than lanes
  for bad in (0, -1, 1.5):
    with pytest.raises(ValueError, match="rl.lane_processes"):
      lanes.process_count(c(bad), 3)


def test_rl_reward_plateau_rule():
  from mopd_jax import rl
  hist = lambda rewards: [(i, {"reward": r}) for i, r in enumerate(rewards)]
  rising, flat = [0.1, 0.2, 0.3, 0.4], [0.5, 0.52, 0.49, 0.51]
  assert not rl.plateaued(hist(rising), 2, 0.02)  # +0.2 between the two windows
  assert rl.plateaued(hist(flat), 2, 0.02)  # -0.01
  assert not rl.plateaued(hist(flat[:3]), 2, 0.02)  # fewer than two windows yet
  assert not rl.plateaued(hist(flat), 0, 0.02)  # off
