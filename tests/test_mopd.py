"""MOPD (mopd_jax/training/mopd.py): which prompts each (domain, effort) cell gets, the effort-free
teachers' view of the student's rollouts, and the exact full-vocabulary KL diagnostic."""
import numpy as np
import pytest


def test_mopd_cell_prompts_shared_or_distinct_across_efforts():
  from mopd_jax.tasks import grid as grid_mod
  from toy_grid import DOMAINS
  from mopd_jax.training import mopd
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


@pytest.mark.parametrize("teacher_sees_effort", [False, True])
def test_teacher_scores_do_not_depend_on_the_students_effort(teacher_sees_effort):
  """K3 eq. 15: the teacher is not conditioned on the effort. The same response, sampled
  after the student's prompt with <low> and with <max>, is laid out by `_assemble` for its
  teachers after the prompt `PromptView.teacher` gives: effort-free, the teachers' tokens are
  identical whichever effort the student's prompt carried, and so are the log-probs a model
  gives them, moved back onto the student's positions; they equal the model's own
  teacher-forced log-probs of prompt-without-effort + response. In the ablation the teachers
  score the student's own layout, which carries the effort token."""
  import jax
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.models import logprobs
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.tasks import get_task, views
  from mopd_jax.teachers import bank as teachers
  from mopd_jax.training import mopd
  tok = CharTokenizer()
  cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=32)
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  names = ("gen/low", "gen/max")
  bank = teachers.build_bank(cfg, {n: params for n in names})
  view = views.PromptView(teacher_sees_effort)
  task = get_task("gen")
  exs = task.generate(0, 3)
  rows, efforts = exs + exs, ["low"] * 3 + ["max"] * 3
  response = tok.encode("12+3=15\n#15") + [tok.eos_id]
  n = len(response)

  def traj(ex, shown):
    return rollout.Trajectory(rollout.encode_prompt(tok, ex, shown), response, [1] * n,
                              [0.0] * n, True)

  trajs = [traj(ex, view.student(e)) for ex, e in zip(rows, efforts)]
  setup = mopd.StepSetup(bank, rollout.RolloutEngine(cfg, tok, max_response_tokens=n),
                         {"gen": task}, [("gen", "low"), ("gen", "max")],
                         {"low": 0.3, "max": 1.5}, 32, view)
  sampled = mopd._assemble(setup, rows, efforts, trajs=trajs,
                           texts=[tok.decode(response)] * 6, rows_per_teacher=3)
  toks, mask = np.asarray(sampled.tokens), np.asarray(sampled.input_mask)  # [K=2, b=3, T']
  assert [bank.router.index("gen", e) for e in ("low", "max")] == [0, 1]
  score = jax.jit(lambda t, m: logprobs.token_logprobs(cfg, params, t, input_mask=m))
  lp = np.asarray(score(toks.reshape(6, -1), mask.reshape(6, -1))).reshape(toks.shape)
  on_student = sampled.student_layout(teachers.scatter_stratified(lp, sampled.index, 6))
  scores = on_student[sampled.arr["loss_mask"]].reshape(2, 3, n)  # [low, max] rows
  if teacher_sees_effort:
    assert sampled.spans is None  # the student's own layout, effort token included
    np.testing.assert_array_equal(toks[:, :, :sampled.arr["tokens"].shape[1]].reshape(6, -1),
                                  sampled.arr["tokens"])
    assert not np.array_equal(toks[0], toks[1])
    assert not np.array_equal(scores[0], scores[1])
    return
  assert all(ps == pt + 1 for ps, pt, _ in sampled.spans)  # the student's has the token
  np.testing.assert_array_equal(toks[0], toks[1])
  np.testing.assert_array_equal(mask[0], mask[1])
  np.testing.assert_array_equal(scores[0], scores[1])
  # The model's teacher-forced log-probs of prompt-without-effort + response, same width.
  free = rollout.pad_batch([traj(ex, None) for ex in exs], tok.pad_id, toks.shape[-1])
  want = np.asarray(score(free["tokens"], free["input_mask"]))[free["loss_mask"]]
  np.testing.assert_array_equal(scores[0].ravel(), want)


@pytest.mark.parametrize("effort_free", [False, True])
def test_exact_kl_equals_the_dense_full_vocabulary_kl(effort_free):
  """`exact_kl_rows`: chunked, stratified by teacher, moved back to the student's positions
  (effort-free teachers score after a shorter prompt), it equals sum_v p_s (log p_s - log p_t)
  from dense [B, T, V] logits of the student and each row's routed teacher, on every
  generated token, and is 0 elsewhere. The teachers are deeper than the student."""
  import jax
  from mopd_jax import models
  from mopd_jax.training import vocab_kl
  import mopd_batches
  b = mopd_batches.random_rollouts(effort_free)
  s_cfg, t_cfg, student, bank, sampled = b.s_cfg, b.t_cfg, b.student, b.bank, b.sampled
  trajs, arr, t_arr, spans, tid = b.trajs, b.arr, b.t_arr, b.spans, b.tid
  got = vocab_kl.exact_kl_rows(s_cfg, student, bank, sampled=sampled, chunk_size=16)

  fwd = jax.jit(lambda cfg, p, t, m: jax.nn.log_softmax(models.forward(cfg, p, t,
                                                                       input_mask=m), -1),
                static_argnums=0)
  ls = np.asarray(fwd(s_cfg, student, arr["tokens"], arr["input_mask"]))
  lt = {k: np.asarray(fwd(t_cfg, jax.tree.map(lambda x, k=k: x[k], bank.params),
                          t_arr["tokens"], t_arr["input_mask"])) for k in range(2)}
  for b in range(5):
    ps = len(trajs[b].prompt_ids)
    pt = ps if spans is None else spans[b][1]
    for j in range(trajs[b].num_tokens):  # token at ps + j, predicted at ps + j - 1
      s_row, t_row = ls[b, ps + j - 1], lt[tid[b]][b, pt + j - 1]
      want = float(np.sum(np.exp(s_row) * (s_row - t_row)))
      np.testing.assert_allclose(got[b, ps + j], want, rtol=2e-4, atol=2e-5)
  assert np.all(got[~arr["loss_mask"]] == 0) and np.all(got[arr["loss_mask"]] > 0)
