"""Continuous batching: every row equals the static sampler's, one program per shape."""
import jax
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.io.tokenizer import CharTokenizer
from mopd_jax.rollout import continuous, sampling, turns as rollout
from mopd_jax.runtime import sharding
from mopd_jax.tasks import get_task

CFG = models.ModelConfig(vocab_size=61, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=8, mlp_dim=64, max_seq_len=96, qk_norm=True)
ONE_LAYER = CFG.replace(num_layers=1)  # the cheaper compile, where layers do not matter
RS = np.random.RandomState(0)
PROMPTS = [list(RS.randint(5, 60, size=RS.randint(1, 12))) for _ in range(13)]
CAPS = RS.randint(1, 30, size=13).astype(np.int32)


@pytest.fixture(scope="module")
def params():
  p = models.init_params(CFG, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)  # peaked: stops happen


@pytest.fixture(scope="module")
def params1():
  p = models.init_params(ONE_LAYER, jax.random.PRNGKey(0))
  return jax.tree.map(lambda x: x * 3.0 if x.ndim == 2 else x, p)


def _assert_same(static, cont):
  static = jax.device_get(static)
  for f in ("tokens", "input_mask", "loss_mask", "prompt_lengths", "lengths", "stopped"):
    np.testing.assert_array_equal(getattr(static, f), getattr(cont, f), err_msg=f)
  np.testing.assert_allclose(static.logprobs, cont.logprobs, atol=3e-5)  # reassociation


@pytest.mark.parametrize("kw, slots, admission, block", [
    (dict(temperature=0.7, top_p=0.9), 5, "fifo", 8),
    pytest.param(dict(greedy=True), 4, "longest_cap_first", None, marks=pytest.mark.slow),
])
def test_rows_equal_the_static_sampler(params, monkeypatch, kw, slots, admission, block):
  """Tokens, masks, lengths and stop flags equal, log-probs to float reassociation, with
  three stop tokens and per-row caps (rows finish in an order unrelated to the queue's),
  greedy and sampled, whatever the slots and the admission order. With 8-slot attention
  blocks every cache here takes the blocked path, where rows at different lengths share a
  decode step (blocks past a row's end are fully masked)."""
  if block:
    from mopd_jax.models import transformer
    monkeypatch.setattr(transformer, "DECODE_BLOCK", block)
  scfg = sampling.SamplingConfig(max_new_tokens=30, stop_tokens=(3, 4, 7), **kw)
  rng = jax.random.PRNGKey(2)
  static = sampling.Sampler(CFG, scfg)(params, PROMPTS, rng, max_new=CAPS)
  cs = continuous.ContinuousSampler(CFG, scfg, slots, admission=admission)
  out = cs(params, PROMPTS, rng, max_new=CAPS)
  _assert_same(static, out)
  lengths = np.asarray(out.lengths)
  assert out.stopped.any() and (~out.stopped & (lengths == CAPS)).any()  # both ends occur
  assert cs.last_stats["decode_calls"] > 1  # slots were refilled


def test_one_program_per_bucket_and_slots(params1):
  """Queues of 4, 13 and 40 rows in one bucket trace each program once (the queue length
  is not a shape), and so do 3 rows (one slot left empty); a second bucket would be a
  second trace."""
  scfg = sampling.SamplingConfig(max_new_tokens=6, buckets=(16, 32))
  cs = continuous.ContinuousSampler(ONE_LAYER, scfg, 4, max_traces=1)
  rng = jax.random.PRNGKey(0)
  for n in (4, 13, 40):
    cs(params1, (PROMPTS * 4)[:n], rng)
  # 3 rows in 4 slots: one slot starts empty (done), still the same programs.
  _assert_same(sampling.Sampler(ONE_LAYER, scfg)(params1, PROMPTS[:3], rng),
               cs(params1, PROMPTS[:3], rng))
  with pytest.raises(AssertionError):
    cs(params1, [[5] * 20] * 6, rng)


def test_slots_of_a_short_queue():
  """Short queues use a power of two of slots, never under a quarter of them: three shapes."""
  assert [continuous.rollout_slots(q, 32) for q in (1, 3, 8, 9, 16, 17, 40)] == \
      [8, 8, 8, 16, 16, 32, 32]
  assert {continuous.rollout_slots(q, 5) for q in range(1, 9)} == {2, 4, 5}


def test_bad_arguments(params):
  scfg = sampling.SamplingConfig(max_new_tokens=4)
  for slots in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
      continuous.ContinuousSampler(CFG, scfg, slots)
  with pytest.raises(ValueError, match="admission must be one of"):
    continuous.ContinuousSampler(CFG, scfg, 2, admission="random")
  cs = continuous.ContinuousSampler(CFG, scfg, 2)
  with pytest.raises(ValueError, match="empty batch"):
    cs(params, [], jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="max_new must be >= 1"):
    cs(params, PROMPTS[:2], jax.random.PRNGKey(0), max_new=np.array([0, 2]))


def test_slots_sharded_over_the_mesh_equal_single_device(params1):
  """Params on a 4 x 2 (data x tensor) mesh: the slots split over `data`, the rows equal the
  single-device run's."""
  mesh = sharding.make_mesh({"data": 4, "tensor": 2})
  sharded = jax.device_put(params1, sharding.param_shardings(ONE_LAYER, mesh))
  scfg = sampling.SamplingConfig(max_new_tokens=20, stop_tokens=(3, 4))
  rng = jax.random.PRNGKey(4)
  cs = continuous.ContinuousSampler(ONE_LAYER, scfg, 4)
  assert cs._state(sharded, 36, 4).token.sharding.spec == jax.sharding.PartitionSpec(
      ("data", "fsdp"))
  _assert_same(cs(params1, PROMPTS, rng, max_new=CAPS), cs(sharded, PROMPTS, rng, max_new=CAPS))


@pytest.mark.slow  # guarded by every default-tier pipeline run (agt's multi-turn rollouts)
def test_engine_with_decode_slots_equals_static():
  """The rollout engine with continuous batching (multi-turn agt with tool observations
  included) gives the trajectories of the static engine."""
  tok = CharTokenizer()
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, d_model=32, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=256)
  p = models.init_params(cfg, jax.random.PRNGKey(0))
  task = get_task("agt")
  exs = task.generate(0, 5)
  budgets = [10, 40, 25, 5, 33]
  runs = [rollout.RolloutEngine(cfg, tok, max_response_tokens=40, max_turns=2,
                                decode=rollout.DecodeOptions(decode_slots=slots)).run(
      p, exs, ["high"] * 5, budgets=budgets, rng=jax.random.PRNGKey(5),
      environment=task.environment)
      for slots in (0, 2)]
  for a, b in zip(runs[0].trajectories, runs[1].trajectories):
    assert a.ids == b.ids and a.gen_mask == b.gen_mask and a.finished == b.finished
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  np.testing.assert_array_equal(runs[0].over_budget, runs[1].over_budget)


def test_temperatures_share_the_programs(params1):
  """Greedy, 0.5 and 1 run one set of programs (the temperature is an argument); each
  still draws what its own static sampler draws."""
  rng = jax.random.PRNGKey(4)
  samplers = []
  for kw in (dict(greedy=True), dict(temperature=0.5), dict(temperature=1.0)):
    scfg = sampling.SamplingConfig(max_new_tokens=12, stop_tokens=(3,), **kw)
    cs = continuous.ContinuousSampler(ONE_LAYER, scfg, 4)
    _assert_same(sampling.Sampler(ONE_LAYER, scfg)(params1, PROMPTS, rng, max_new=CAPS),
                 cs(params1, PROMPTS, rng, max_new=CAPS))
    samplers.append(cs)
  for name in ("_fill", "_insert", "_decode"):
    program = getattr(samplers[0], name)
    assert all(getattr(cs, name) is program for cs in samplers), name
    assert program._cache_size() == 1, name  # pylint: disable=protected-access
