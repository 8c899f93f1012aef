"""The RL lane's pieces (mopd_jax/training/rl.py, mopd_jax/stages/lanes.py): phase settings, batch widths,
the plateau rule, lane process counts."""
import pytest


def test_rl_phase_settings():
  import ml_collections
  from mopd_jax.training import rl
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
  from mopd_jax.rollout import turns as rollout
  w = rollout.padded_width
  assert [w(n, pow2=True, floor=64) for n in (1, 40, 64, 65, 93, 128, 129)] == \
      [64, 64, 64, 128, 128, 128, 256]
  assert w(20, pow2=True, floor=16) == 32
  assert [w(n) for n in (1, 16, 17, 40)] == [16, 16, 32, 48]
  assert [w(n, 32) for n in (1, 32, 33)] == [32, 32, 64]


def test_rl_lane_processes():
  import ml_collections
  from mopd_jax.stages import lanes
  c = lambda k: ml_collections.ConfigDict(dict(lane_processes=k))
  assert lanes.process_count(c(3), 3) == 3
  assert lanes.process_count(c(8), 4) == 4  # never more processes than lanes
  for bad in (0, -1, 1.5):
    with pytest.raises(ValueError, match="rl.lane_processes"):
      lanes.process_count(c(bad), 3)


def test_rl_reward_plateau_rule():
  from mopd_jax.training import rl
  hist = lambda rewards: [(i, {"reward": r}) for i, r in enumerate(rewards)]
  rising, flat = [0.1, 0.2, 0.3, 0.4], [0.5, 0.52, 0.49, 0.51]
  assert not rl.plateaued(hist(rising), 2, 0.02)  # +0.2 between the two windows
  assert rl.plateaued(hist(flat), 2, 0.02)  # -0.01
  assert not rl.plateaued(hist(flat[:3]), 2, 0.02)  # fewer than two windows yet
  assert not rl.plateaued(hist(flat), 0, 0.02)  # off


def test_rl_phase_samples_from_the_held_reference():
  """`sample_from="reference"`: a phase whose PMD old policy is held fixed draws its samples
  from that policy (Kimi K1.5's PMD), so its batches do not depend on the policy being
  trained; "policy" draws from the trained one; a phase without a held policy draws from the
  trained one either way."""
  import jax
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.runtime import sharding
  from mopd_jax.tasks import get_task
  from mopd_jax.training import rl, step as train
  tok = CharTokenizer()
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=256)
  ref = models.init_params(cfg, jax.random.PRNGKey(0))
  start = models.init_params(cfg, jax.random.PRNGKey(1))
  task = get_task("gen")
  stream = [task.generate(k, 2) for k in range(2)]
  engine = rollout.RolloutEngine(cfg, tok, max_response_tokens=12, max_turns=1)
  used = []
  real_run = engine.run
  engine.run = lambda params, *a, **k: used.append(params) or real_run(params, *a, **k)
  trainer = train.Trainer(cfg, train.LossConfig(kind="pmd", group_size=2, tau_kl=0.5),
                          train.OptimConfig(lr=1e-3, warmup_steps=0, total_steps=2),
                          mesh=sharding.make_mesh({}, jax.devices()[:1]))

  def run(sample_from, reference):
    used.clear()
    rl.run_effort(trainer, trainer.init(start),
                  rl.PhaseSampling(engine, reference=reference, sample_from=sample_from),
                  task=task, next_examples=lambda step: stream[step],
                  phase=rl.EffortPhase(effort="high", tau=1.0, phase=1, steps=2, group_size=2,
                                       width=64, seed=0))
    return list(used)

  assert all(p is ref for p in run("reference", ref))
  on_policy = run("policy", ref)
  assert len(on_policy) == 2 and not any(p is ref for p in on_policy)
  assert not any(p is ref for p in run("reference", None))
  # "both": each step draws half of each group from the trained policy, half from the held
  # one, and the batch keeps the groups' order (row i of a group of 2: policy, reference).
  both = run("both", ref)
  assert len(both) == 4 and [p is ref for p in both] == [False, True, False, True]
  split = rl._run_split(engine, (start, ref), stream[0] * 1, shown=["high"] * 2,
                        budgets=[30, 30], rng=jax.random.PRNGKey(0), group_size=2,
                        environment=None)
  alone = real_run(start, stream[0][:1], ["high"], budgets=[30],
                   rng=jax.random.fold_in(jax.random.PRNGKey(0), 0))
  assert split.trajectories[0].ids == alone.trajectories[0].ids
  with pytest.raises(ValueError, match="sample_from"):
    run("teacher", ref)
