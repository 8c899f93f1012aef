"""MOPD prompt selection (mopd_jax/mopd.py): which prompts each (domain, effort) cell gets."""
import numpy as np


def test_mopd_cell_prompts_shared_or_distinct_across_efforts():
  from mopd_jax import grid as grid_mod, mopd
  from mopd_jax.tasks import TOY_DOMAINS as DOMAINS
  grid = grid_mod.Grid(DOMAINS, tuple(grid_mod.Effort(e, t) for e, t in
                                      (("low", 0.3), ("high", 0.7), ("max", 1.5))))

  def iters(n):
    return {d: iter([[f"{d}{i}" for i in range(n)]]) for d in DOMAINS}

  shared = mopd.cell_prompts(iters(2), grid, 2, shared=True)
  assert len(shared) == 9  # domain-major: (gen, low), (gen, high), (gen, max), (agt, low), ...
  assert shared[0] == shared[1] == shared[2] == ["gen0", "gen1"]
  assert shared[3] == shared[5] == ["agt0", "agt1"]
  distinct = mopd.cell_prompts(iters(6), grid, 2, shared=False)
  assert distinct[:3] == [["gen0", "gen1"], ["gen2", "gen3"], ["gen4", "gen5"]]
  assert distinct[8] == ["cod4", "cod5"]
  # An effort mix: every prompt in exactly one of its domain's cells, efforts as drawn.
  rng = np.random.RandomState(0)
  mixed = mopd.cell_prompts(iters(600), grid, 200, shared=False, mix=(0.0, 1.0, 3.0),
                            rng=rng)
  for i, d in enumerate(DOMAINS):
    low, high, top = mixed[3 * i:3 * i + 3]
    assert low == [] and sorted(high + top) == sorted(f"{d}{j}" for j in range(600))
    assert 0.2 < len(high) / 600 < 0.3  # weight 1 of 4


def test_effort_free_teacher_scores_equal_whatever_the_students_effort():
  """K3 eq. 15: the teacher is not conditioned on the effort. A response sampled after the
  student's prompt with <low> or with <max> is scored by the teacher after the same
  effort-free prompt: its log-probs, moved back to the student's positions, are identical,
  and they equal the teacher's own teacher-forced log-probs of prompt-without-effort +
  response."""
  import jax
  from mopd_jax import logprobs, models, mopd, rollout
  from mopd_jax.tasks import get_task
  from mopd_jax.tokenizer import CharTokenizer
  tok = CharTokenizer()
  cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=32)
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  exs = get_task("gen").generate(0, 3)
  response = tok.encode("12+3=15\n#15") + [tok.eos_id]
  scores = {}
  for effort in ("low", "max"):
    trajs = [rollout.Trajectory(rollout.encode_prompt(tok, ex, effort), response,
                                [1] * len(response), [0.0] * len(response), True)
             for ex in exs]
    arr, spans = mopd.teacher_view(tok, trajs, exs)
    assert all(ps == pt + 1 for ps, pt, _ in spans)  # the student's prompt has the token
    lp = np.asarray(logprobs.token_logprobs(cfg, params, arr["tokens"],
                                            input_mask=arr["input_mask"]))
    student = rollout.pad_batch(trajs, tok.pad_id, 64)
    scores[effort] = mopd.realign(lp, spans, 64)[student["loss_mask"]]
    # Unaligned check: the teacher's own layout, response positions.
    for i, (_, pt, n) in enumerate(spans):
      np.testing.assert_array_equal(lp[i, pt:pt + n],
                                    scores[effort].reshape(len(exs), -1)[i])
  np.testing.assert_array_equal(scores["low"], scores["max"])
  # The ablation (the teacher sees the student's prompt) differs.
  assert tok.encode_prompt(exs[0].prompt, None) != rollout.encode_prompt(tok, exs[0], "max")
