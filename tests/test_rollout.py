"""Rollouts: observation masking, budgets, and partial rollouts equal one-go rollouts."""
import jax
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.io.tokenizer import CharTokenizer
from mopd_jax.rollout import turns as rollout
from mopd_jax.tasks import get_task

TOK = CharTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=256)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.PRNGKey(0))


def _engine(**kw):
  return rollout.RolloutEngine(CFG, TOK, max_response_tokens=48, max_turns=3, **kw)


@pytest.mark.parametrize("domain", ["gen", "agt"])
def test_partial_rollout_equals_one_go(params, domain):
  task = get_task(domain)
  exs = task.generate(0, 4)
  eng = _engine()
  rng = jax.random.PRNGKey(5)
  budgets = [40] * len(exs)
  whole = eng.run(params, exs, ["high"] * 4, budgets=budgets, rng=rng, environment=task.environment)
  part = eng.run(params, exs, ["high"] * 4, budgets=budgets, rng=rng, environment=task.environment,
                 step_budget=7)
  for _ in range(20):  # continue until nothing is left to decode
    part = eng.run(params, exs, ["high"] * 4, budgets=budgets, rng=rng,
                   environment=task.environment,
                   resume=part.trajectories, step_budget=7)
  for a, b in zip(whole.trajectories, part.trajectories):
    assert a.ids == b.ids and a.gen_mask == b.gen_mask
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert a.finished == b.finished


def test_budget_cuts_and_flags_over_budget(params):
  task = get_task("gen")
  exs = task.generate(1, 6)
  res = _engine().run(params, exs, ["low"] * 6, budgets=[3] * 6, rng=jax.random.PRNGKey(0))
  for t, over in zip(res.trajectories, res.over_budget):
    assert t.num_tokens <= 3
    assert over == (not t.finished)


def test_observations_are_masked_and_padded_batch_aligns():
  task = get_task("agt")
  ex = task.generate(0, 1)[0]
  traj = rollout.sft_trajectory(TOK, ex, "max", response=ex.solutions["full"])
  text_ids = traj.ids
  inside = False
  for i, m in zip(text_ids, traj.gen_mask):
    if i == TOK.obs_id:
      inside = True
    assert m == (0 if inside else 1)
    if i == TOK.obs_end_id:
      inside = False
  arr = rollout.pad_batch([traj], TOK.pad_id)
  p = len(traj.prompt_ids)
  assert not arr["loss_mask"][0, :p].any()
  assert arr["loss_mask"][0].sum() == sum(traj.gen_mask)
  assert arr["tokens"].shape[1] % 16 == 0


def test_batch_buckets_are_powers_of_two_from_a_quarter_of_the_batch():
  # few live rows still share the quarter-batch compilation; the full batch caps the bucket
  assert [rollout.batch_bucket(n, 64) for n in (1, 5, 16, 17, 33, 64)] == [16, 16, 16, 32,
                                                                          64, 64]
  assert [rollout.batch_bucket(n, 96) for n in (1, 30, 40, 96)] == [32, 32, 64, 96]
  assert [rollout.batch_bucket(n, 3) for n in (1, 2, 3)] == [1, 2, 3]
