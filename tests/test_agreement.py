"""The held-out log-ratio of a policy to its cell's teacher (mopd_jax/evaluation/agreement.py): equal to
a dense reference (the policy's teacher-forced log-probs after its own prompt, the teacher's
after the effort-free prompt, averaged over each row's generated tokens), through the
in-process scorer and through a teacher server's client."""
import jax
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.evaluation import agreement
from mopd_jax.io.tokenizer import CharTokenizer
from mopd_jax.models import logprobs
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import sharding
from mopd_jax.tasks import get_task
from mopd_jax.teachers import bank as teachers, client as teacher_client, placement, server as serve

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


def _kl_setup(bank, view):
  from mopd_jax.training import mopd  # noqa: F401
  from mopd_jax.tasks import views
  engine = rollout.RolloutEngine(CFG, TOK, max_response_tokens=12,
                                 decode=rollout.DecodeOptions(decode_slots=4))
  cells = [("gen", n.split("/")[1]) for n in NAMES]
  return mopd.StepSetup(bank, engine, {"gen": get_task("gen")}, cells,
                        {"low": 0.3, "high": 0.7, "max": 1.5}, view=view)


def test_heldout_kl_is_the_token_mean_of_the_exact_kl_with_its_error():
  """Every prompt at every effort, sampled in batches: the overall and per-cell values are the
  token means of `vocab_kl.exact_kl_rows` over the same rollouts, the error is the ratio
  estimator's over rollouts; a policy scored by itself after its own prompt gives 0."""
  from mopd_jax.tasks import views
  from mopd_jax.training import mopd, vocab_kl
  policy, bank, _, _ = _setup()
  exs = get_task("gen").generate(3, 4)
  setup = _kl_setup(bank, views.PromptView(teacher_sees_effort=False))
  rng = jax.random.PRNGKey(3)
  got = agreement.heldout_kl(CFG, policy, setup, scoring=bank, examples={"gen": exs}, rng=rng,
                             batch=2)
  assert got["rollouts"] == 12 and set(got["cells"]) == set(NAMES)
  sums, counts, cells = [], [], []
  for i, start in enumerate((0, 2)):  # the batches heldout_kl draws, by hand
    sampled = mopd.sample_batch(setup, policy, [exs[start:start + 2]] * 3,
                                rng=jax.random.fold_in(rng, i))
    kl = vocab_kl.exact_kl_rows(CFG, policy, bank, sampled=sampled)
    mask = np.asarray(sampled.arr["loss_mask"], bool)[:6]
    sums += list((kl[:6] * mask).sum(1))
    counts += list(mask.sum(1))
    cells += list(sampled.cell_ids[:6])
  sums, counts, cells = map(np.asarray, (sums, counts, cells))
  mean = sums.sum() / counts.sum()
  se = np.sqrt(12 / 11 * np.sum((sums - mean * counts) ** 2)) / counts.sum()
  assert got["tokens"] == counts.sum()
  np.testing.assert_allclose([got["kl_exact"], got["kl_exact_se"]], [mean, se], rtol=1e-6)
  for j, name in enumerate(NAMES):
    sel = cells == j
    np.testing.assert_allclose(got["cells"][name]["kl_exact"],
                               sums[sel].sum() / counts[sel].sum(), rtol=1e-6)
  assert got["kl_exact"] > 0.01  # random teachers are far from the policy
  same = teachers.build_bank(CFG, [policy] * 3, names=NAMES)
  zero = agreement.heldout_kl(CFG, policy, _kl_setup(same, views.EFFORT_EVERYWHERE),
                              scoring=same, examples={"gen": exs}, rng=rng, batch=4)
  assert abs(zero["kl_exact"]) < 1e-5 and zero["kl_exact_se"] < 1e-5


def test_kl_onsets_find_the_position_where_rollouts_leave_the_track():
  """Three rows of one cell: position 1 is an error in one row (2 nats, after which its KL
  stays high) and about 0 elsewhere; among the positions half the rows reach (the lone long
  row's last position is left out) `kl_onsets` ranks position 2 first (mean 1.5 over the two
  rows reaching it) and the error's own second, counts the one row above the threshold at
  each and gives its share of the cell's and of every cell's summed KL."""
  rows = {"agt/max": [[0.0, 2.0, 3.0, 9.0], [0.1, 0.0], [0.1, 0.0, 0.0]], "gen/low": [[1.0]]}
  o = agreement.kl_onsets(rows, threshold=0.5, top=2)
  first = o["agt/max"][0]
  assert first["position"] == 2 and np.isclose(first["mean_kl"], 1.5)  # rows 1 and 3 reach it
  assert first["rows_above"] == 1 and first["rows"] == 3
  np.testing.assert_allclose(first["share_of_cell"], 14.0 / 14.2)
  np.testing.assert_allclose(first["share_of_all"], 14.0 / 15.2)
  assert o["agt/max"][1]["position"] == 1 and o["agt/max"][1]["rows_above"] == 1
  assert [p["position"] for p in o["gen/low"]] == [0]

