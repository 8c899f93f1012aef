"""The held-out log-ratio of a policy to its cell's teacher (mopd_jax/agreement.py): equal to
a dense reference (the policy's teacher-forced log-probs after its own prompt, the teacher's
after the effort-free prompt, averaged over each row's generated tokens), through the
in-process scorer and through a teacher server's client."""
import jax
import numpy as np
import pytest

from mopd_jax import agreement, logprobs, models, placement, rollout, serve, sharding
from mopd_jax import teacher_client, teachers
from mopd_jax.tasks import get_task
from mopd_jax.tokenizer import CharTokenizer

TOK = CharTokenizer()
CFG = models.get_preset("toy", vocab_size=TOK.vocab_size, num_layers=1, d_model=32,
                        quant="int4", quant_group=16)
NAMES = ("gen/low", "gen/high", "gen/max")


def _setup():
  policy = models.init_params(CFG, jax.random.PRNGKey(1))
  bank = teachers.build_bank(CFG, [models.init_params(CFG, jax.random.PRNGKey(5 + i))
                                   for i in range(len(NAMES))], names=NAMES)
  exs = get_task("gen").generate(0, 5)
  rng = np.random.RandomState(0)
  trajs = []
  for i, ex in enumerate(exs):
    ids = rng.randint(20, 60, size=rng.randint(3, 9)).tolist() + [TOK.eos_id]
    gen = [1] * len(ids)
    if i == 2:
      gen[1] = gen[2] = 0  # an observation inside the response: no score
    trajs.append(rollout.Trajectory(rollout.encode_prompt(TOK, ex, "high"), ids, gen,
                                    [0.0] * len(ids), True))
  return policy, bank, exs, trajs


def _dense(policy, bank, exs, trajs, *, cell):
  """The reference, one row at a time: no padding, no stratification, no realignment."""
  out = []
  for ex, t in zip(exs, trajs):
    seq = np.asarray([t.prompt_ids + t.ids])
    lp = np.asarray(logprobs.token_logprobs(CFG, policy, seq))[0, len(t.prompt_ids):]
    tp = rollout.encode_prompt(TOK, ex, None)  # the teacher's prompt: no effort
    tseq = np.asarray([tp + t.ids])
    p_t = jax.tree.map(lambda x: x[cell], bank.params)
    lt = np.asarray(logprobs.token_logprobs(CFG, p_t, tseq))[0, len(tp):]
    g = np.asarray(t.gen_mask, bool)
    out.append((lp - lt)[g].mean())
  return np.asarray(out)


def test_row_logratios_equal_the_dense_reference():
  policy, bank, exs, trajs = _setup()
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  scorer = placement.TeacherScorer(bank, mesh, mesh)
  for cell in (1, 2):
    scoring = agreement.Scoring(scorer, cell, len(NAMES), None, rows=8)
    got = agreement.row_logratios(CFG, policy, TOK, trajs=trajs, examples=exs, scoring=scoring)
    np.testing.assert_allclose(got, _dense(policy, bank, exs, trajs, cell=cell), atol=1e-5)
  # A policy scored by itself with the prompt it answered: 0 on every row.
  same = teachers.build_bank(CFG, [policy], names=("gen/high",))
  scoring = agreement.Scoring(placement.TeacherScorer(same, mesh, mesh), 0, 1, "high")
  got = agreement.row_logratios(CFG, policy, TOK, trajs=trajs, examples=exs, scoring=scoring)
  np.testing.assert_allclose(got, 0.0, atol=1e-5)


def test_row_logratios_through_a_teacher_server():
  """The same numbers when the teachers answer over HTTP (vLLM's schema) as in process."""
  policy, bank, exs, trajs = _setup()
  srv = serve.TeacherServer(bank, TOK)
  url = srv.start()
  client = teacher_client.EndpointScorer(NAMES, {n: url for n in NAMES})
  try:
    scoring = agreement.Scoring(client, 2, len(NAMES), None, rows=8)
    got = agreement.row_logratios(CFG, policy, TOK, trajs=trajs, examples=exs, scoring=scoring)
  finally:
    client.close()
    srv.stop()
  np.testing.assert_allclose(got, _dense(policy, bank, exs, trajs, cell=2), atol=1e-5)


def test_a_response_without_generated_tokens_scores_zero():
  policy, bank, exs, trajs = _setup()
  trajs[0] = rollout.Trajectory(trajs[0].prompt_ids, [7], [0], [0.0], True)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  scoring = agreement.Scoring(placement.TeacherScorer(bank, mesh, mesh), 0, len(NAMES), None)
  got = agreement.row_logratios(CFG, policy, TOK, trajs=trajs, examples=exs, scoring=scoring)
  assert got[0] == 0.0 and np.all(np.isfinite(got))
  with pytest.raises(IndexError):
    agreement.row_logratios(CFG, policy, TOK, trajs=[], examples=[], scoring=scoring)
