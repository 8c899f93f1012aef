"""The teacher server (mopd_jax/teachers/server.py) on loopback: its log-probs equal in-process scoring
of the same params for every cell over mixed lengths (through the client), its answers follow
vLLM's `prompt_logprobs` schema, concurrent requests share prefills, and it stops cleanly
(in the background and on SIGTERM)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import configure, models
from mopd_jax.io import tokenizer
from mopd_jax.models import logprobs
from mopd_jax.teachers import bank as teachers, client as teacher_client, server as serve

TOK = tokenizer.CharTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=64, qk_norm=True)
NAMES = ("gen/low", "gen/max", "agt/max")
K, B, T = len(NAMES), 3, 24


def _bank():
  plist = [models.init_params(CFG, jax.random.PRNGKey(10 + k)) for k in range(K)]
  return teachers.build_bank(CFG, plist, names=NAMES)


@pytest.fixture(scope="module")
def server():
  srv = serve.TeacherServer(_bank(), TOK, temperature=0.7, max_wait_s=0.02)
  srv.start()
  yield srv
  srv.stop()


def _batch(seed=0):
  r = np.random.RandomState(seed)
  tokens = r.randint(0, CFG.vocab_size, (K, B, T)).astype(np.int32)
  lengths = r.randint(1, T + 1, (K, B))
  lengths[0, 0], lengths[1, 1], lengths[2, 2] = T, 1, 0  # full, one token, a padding row
  mask = np.arange(T) < lengths[..., None]
  return tokens, mask


def _post(url, body):
  req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                               headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=30) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _get(url):
  with urllib.request.urlopen(url, timeout=30) as r:
    return r.status, r.read()


@pytest.mark.parametrize("top_k", [0, 4])
def test_server_equals_in_process_scoring(server, top_k):
  tokens, mask = _batch()
  hot = server.bank  # the params at the server's temperature, as the MOPD stage scores
  ref = jax.jit(teachers.score_stratified, static_argnames="top_k")(hot, tokens, mask,
                                                                    top_k=top_k)
  scorer = teacher_client.EndpointScorer(NAMES, {n: server.url for n in NAMES}, top_k=top_k)
  try:
    got = scorer(tokens, mask)
  finally:
    scorer.close()
  if top_k:
    got, got_lp, got_ids = got
    ref, ref_lp, ref_ids = (np.asarray(x) for x in ref)
    m = mask[..., None] & (np.arange(T) > 0)[:, None]  # position 0: nothing predicts it
    np.testing.assert_array_equal(np.where(m, got_ids, 0), np.where(m, ref_ids, 0))
    np.testing.assert_allclose(np.where(m, got_lp, 0), np.where(m, ref_lp, 0), atol=1e-5)
  ref = np.asarray(ref)
  assert got.shape == (K, B, T) and got.dtype == np.float32
  np.testing.assert_allclose(got[mask], ref[mask], atol=1e-5)
  assert not got[~mask].any()  # padding (and the all-padding row) scores 0, sends nothing
  # Every cell was scored by its own teacher: teachers differ, so swapping them would not fit.
  assert np.abs(got[0][mask[0]] - np.asarray(teachers.score_stratified(
      hot, tokens[[1, 0, 2]], mask[[1, 0, 2]]))[1][mask[0]]).max() > 1e-3


def test_answer_schema_is_vllms(server):
  ids = [TOK.bos_id] + TOK.encode("12+3=15")
  status, body = _post(server.url + "/v1/completions",
                       {"model": "gen/max", "prompt": ids, "max_tokens": 1,
                        "prompt_logprobs": 3})
  assert status == 200
  assert body["object"] == "text_completion" and body["model"] == "gen/max"
  plp = body["choices"][0]["prompt_logprobs"]
  assert len(plp) == len(ids) and plp[0] is None
  gen_max = jax.tree.map(lambda x: x[1], server.bank.params)  # at the server's temperature
  full = np.asarray(jax.nn.log_softmax(models.forward(CFG, gen_max, np.asarray([ids]))[0],
                                       axis=-1))
  for t in range(1, len(ids)):
    entry = plp[t]
    assert str(ids[t]) in entry and len(entry) in (3, 4)
    for tid, v in entry.items():
      assert set(v) == {"logprob", "rank", "decoded_token"}
      assert v["decoded_token"] == TOK.decode([int(tid)])
      row = full[t - 1]
      assert abs(v["logprob"] - row[int(tid)]) < 1e-5
      assert v["rank"] == 1 + int((row > row[int(tid)]).sum())
    assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]


def test_endpoints_and_refusals(server):
  assert _get(server.url + "/health")[0] == 200
  models_ = json.loads(_get(server.url + "/v1/models")[1])
  assert [m["id"] for m in models_["data"]] == list(NAMES)
  meta = json.loads(_get(server.url + "/v1/metadata")[1])
  assert meta["cells"] == list(NAMES) and meta["vocab_size"] == CFG.vocab_size
  assert meta["tokenizer_hash"] == tokenizer.fingerprint(TOK)
  assert meta["temperature"] == 0.7 and meta["model_config"]["d_model"] == 32
  status, body = _post(server.url + "/v1/completions",
                       {"model": "cod/low", "prompt": [1, 2], "prompt_logprobs": 0})
  # vLLM's current error body: the error nested under "error".
  assert status == 404 and "gen/low" in body["error"]["message"]
  assert body["error"]["type"] == "NotFoundError" and body["error"]["code"] == 404
  # What vLLM refuses: streaming, no completion token, a prompt that leaves no room for the
  # completion token (64 = max_seq_len), past the logprob cap; and what this server cannot do.
  for bad, what in [({"max_tokens": 5}, "does not generate"), ({"prompt": []}, "prompt"),
                    ({"max_tokens": 0}, "max_tokens"), ({"stream": True}, "stream"),
                    ({"prompt": [1, CFG.vocab_size]}, "outside the vocabulary"),
                    ({"prompt": list(range(1, 65))}, "maximum context length is 64"),
                    ({"prompt_logprobs": 50}, "max_logprobs")]:
    status, body = _post(server.url + "/v1/completions",
                         {"model": "gen/low", "prompt": [1, 2], "prompt_logprobs": 0, **bad})
    assert status == 400 and what in body["error"]["message"], (bad, body)
  status, _ = _post(server.url + "/v1/completions",
                    {"model": "gen/low", "prompt": list(range(1, 64)), "prompt_logprobs": 0})
  assert status == 200


def test_what_vllm_accepts_is_accepted(server):
  """Several prompts in one request (one choice each, in order), `model` omitted (the first
  cell), and the request's temperature, which shapes no prompt log-prob."""
  a, b = [1, 5, 9, 13], [2, 7, 4]
  url = server.url + "/v1/completions"
  one = [_post(url, {"model": "gen/max", "prompt": p, "prompt_logprobs": 1})[1] for p in (a, b)]
  status, both = _post(url, {"model": "gen/max", "prompt": [a, b], "prompt_logprobs": 1,
                             "temperature": 0.3})
  assert status == 200 and [c["index"] for c in both["choices"]] == [0, 1]
  for i, o in enumerate(one):
    assert both["choices"][i]["prompt_logprobs"] == o["choices"][0]["prompt_logprobs"]
    assert both["choices"][i]["prompt_token_ids"] == (a, b)[i]
  status, default = _post(url, {"prompt": a, "prompt_logprobs": 1})
  assert status == 200 and default["model"] == NAMES[0]


def test_an_api_key_guards_the_v1_routes():
  srv = serve.TeacherServer(_bank(), TOK, api_key="s3cret")
  srv.start()
  try:
    assert _get(srv.url + "/health")[0] == 200  # as vLLM: health needs no key
    status, body = _post(srv.url + "/v1/completions", {"prompt": [1, 2], "prompt_logprobs": 0})
    assert status == 401 and body == {"error": "Unauthorized"}
    sc = teacher_client.EndpointScorer(NAMES, {n: srv.url for n in NAMES}, api_key="s3cret")
    lp, _, _ = sc.score_row("gen/low", [1, 2, 3])
    assert lp.shape == (3,) and lp[1] < 0
    with pytest.raises(teacher_client.TeacherRequestError, match="HTTP 401"):
      teacher_client.EndpointScorer(NAMES, {n: srv.url for n in NAMES}).score_row(
          "gen/low", [1, 2, 3])
    sc.close()
  finally:
    srv.stop()


def test_concurrent_requests_share_prefills(server, monkeypatch):
  calls = []
  real = serve.prefill

  def counted(bank, requests, **kw):
    calls.append(len(requests))
    return real(bank, requests, **kw)

  monkeypatch.setattr(serve, "prefill", counted)
  tokens, mask = _batch(seed=1)
  scorer = teacher_client.EndpointScorer(NAMES, {n: server.url for n in NAMES})
  try:
    scorer(tokens, mask)
  finally:
    scorer.close()
  rows = int((mask.sum(-1) > 0).sum())
  assert sum(calls) == rows and len(calls) < rows  # batched: fewer prefills than requests


def test_stop_answers_requests_already_in():
  # A round waits up to 5 s for company: the three requests are all in before it scores.
  srv = serve.TeacherServer(_bank(), TOK, max_wait_s=5.0)
  url = srv.start()
  out = []
  ids = [TOK.bos_id] + TOK.encode("7*6")
  th = [threading.Thread(target=lambda: out.append(_post(
      url + "/v1/completions", {"model": "gen/low", "prompt": ids, "prompt_logprobs": 0})))
        for _ in range(3)]
  for t in th:
    t.start()
  deadline = time.time() + 4
  while srv.pending < 3 and time.time() < deadline:  # every request in, none answered
    time.sleep(0.005)
  assert srv.pending == 3
  srv.stop()
  for t in th:
    t.join()
  assert [s for s, _ in out] == [200, 200, 200]
  with pytest.raises(urllib.error.URLError):
    _get(url + "/health")


def test_command_line_serves_a_checkpoint_and_stops_on_sigterm(tmp_path):
  """`python -m mopd_jax.serve --hf_path DIR --cell gen/max` serves the checkpoint at the
  config's teacher temperature; SIGTERM ends it with status 0."""
  from configs import toy
  from mopd_jax import configure
  from mopd_jax.io import hf
  cfg = configure.model_config(toy.get_config("tiny"), TOK.vocab_size)
  params = models.init_params(cfg, jax.random.PRNGKey(5))
  hf.save_checkpoint(cfg, params, str(tmp_path / "ckpt"))
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  proc = subprocess.Popen(
      [sys.executable, "-m", "mopd_jax.serve", "--config", "configs/toy.py:tiny",
       "--hf_path", str(tmp_path / "ckpt"), "--cell", "gen/max", "--port", "0"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    lines = []
    while not lines or "listening on" not in lines[-1]:
      lines.append(proc.stdout.readline())
      assert lines[-1], "".join(lines)
    url = lines[-1].split("listening on")[1].strip()
    meta = json.loads(_get(url + "/v1/metadata")[1])
    temperature = toy.get_config("tiny").mopd.teacher_temperature
    assert meta["cells"] == ["gen/max"] and meta["temperature"] == temperature
    ids = [TOK.bos_id] + TOK.encode("3+4=7")
    status, body = _post(url + "/v1/completions",
                         {"model": "gen/max", "prompt": ids, "prompt_logprobs": 0})
    hot = models.with_temperature(params, temperature)
    ref = np.asarray(jax.jit(lambda p, t: logprobs.token_logprobs(cfg, p, t))(
        hot, np.asarray([ids])))[0]
    got = [e[str(i)]["logprob"] for e, i in zip(body["choices"][0]["prompt_logprobs"][1:],
                                                 ids[1:])]
    np.testing.assert_allclose(got, ref[1:], atol=1e-5)
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=60)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 0 and "[serve] stopped" in rest, rest[-2000:]


def test_mopd_step_scored_by_the_server_equals_in_process():
  """One MOPD update (mopd.mopd_step) with the server's scores through the client's score_fn
  equals the update with the in-process co-located scorer."""
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.runtime import sharding
  from mopd_jax.tasks import get_task
  import toy_grid
  from mopd_jax.teachers import placement
  from mopd_jax.training import mopd, step as train
  cfg = models.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=128)
  names = toy_grid.NAMES
  bank = teachers.build_bank(cfg, [models.init_params(cfg, jax.random.PRNGKey(20 + k))
                                   for k in range(len(names))], names=names)
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  trainer = train.Trainer(cfg, train.LossConfig(kind="mopd"), train.OptimConfig(lr=1e-2), mesh=mesh)
  tasks = {d: get_task(d) for d in toy_grid.DOMAINS}
  cells = [tuple(n.split("/")) for n in names]
  per_cell = [tasks[d].generate(seed=i, n=2) for i, (d, _) in enumerate(cells)]
  engine = rollout.RolloutEngine(cfg, TOK, max_response_tokens=10, max_turns=1)
  taus = {"max": 1.0, "high": 0.55, "low": 0.25}
  student = models.init_params(cfg, jax.random.PRNGKey(0))
  local = placement.TeacherScorer(bank, mesh, mesh)
  srv = serve.TeacherServer(bank, TOK)
  url = srv.start()
  remote = teacher_client.EndpointScorer(names, {n: url for n in names})
  try:
    remote.check(vocab_size=cfg.vocab_size, tokenizer_hash=tokenizer.fingerprint(TOK),
                 temperature=1.0)
    out = {}
    for name, score_fn in (("local", lambda b, t, m: local(t, m)),
                           ("server", remote.score_fn)):
      setup = mopd.StepSetup(bank, engine, tasks, cells, taus)
      state, rec = mopd.mopd_step(trainer, trainer.init(student), setup,
                                  examples_per_cell=per_cell, rng=jax.random.PRNGKey(3),
                                  r_max=5.0, score_fn=score_fn)
      out[name] = (jax.device_get(state.params), rec)
  finally:
    remote.close()
    srv.stop()
  (p_local, r_local), (p_server, r_server) = out["local"], out["server"]
  assert r_server.metrics["kl"] == pytest.approx(r_local.metrics["kl"], abs=1e-5)
  assert r_server.metrics["loss"] == pytest.approx(r_local.metrics["loss"], abs=1e-5)
  assert abs(r_local.metrics["kl"]) > 1e-3  # the teachers differ from the student
  for cell, m in r_local.cells.items():
    assert r_server.cells[cell]["kl"] == pytest.approx(m["kl"], abs=1e-5)
  for a, b in zip(jax.tree.leaves(p_local), jax.tree.leaves(p_server)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_mopd_stage_checks_its_servers_at_start(tmp_path):
  """The stage's client (`teacher.endpoints` of a tiny toy config) accepts a server of the
  run's tokenizer and vocabulary and refuses one whose tokenizer differs, naming both, and
  one whose max_model_len leaves no room for the run's longest row."""
  import dataclasses
  from configs import toy
  from mopd_jax.stages import context, wiring
  c = toy.get_config("tiny")
  c.mesh.data = jax.device_count()  # the suite's simulated devices
  c.mopd.prompts_per_cell = jax.device_count()
  # Nothing in this process needs the teachers' params (no trained teachers here).
  c.mopd.init, c.mopd.exact_kl_every = "sft", 0
  ctx = context.Run(configure.build(c, jax.device_count()), str(tmp_path))
  cfg = dataclasses.replace(CFG, vocab_size=ctx.model_cfg.vocab_size,
                            max_seq_len=ctx.model_cfg.max_seq_len)
  bank = teachers.build_bank(cfg, [models.init_params(cfg, jax.random.PRNGKey(0))] *
                             len(ctx.grid.names), names=ctx.grid.names)
  other = tokenizer.CharTokenizer(charset=tokenizer.CHARSET[:-1] + "@")  # same size
  short = bank.replace(model_cfg=CFG)  # max_model_len 64: shorter than the run's rows
  servers = [serve.TeacherServer(b, tok, temperature=c.mopd.teacher_temperature)
             for b, tok in ((bank, ctx.tok), (bank, other), (short, ctx.tok))]
  try:
    from mopd_jax.config.schema import ConfigError
    longest = wiring.longest_row(ctx)
    assert 64 < longest + 1 <= ctx.model_cfg.max_seq_len
    # Measured once per run and tokenizer: asked again, it encodes no prompt.
    with mock.patch.object(type(ctx.teacher_tok), "encode_prompt", side_effect=AssertionError):
      assert wiring.longest_row(ctx) == wiring.longest_row(ctx, ctx.teacher_tok) == longest
    refusals = (None, lambda url: f"{url} has tokenizer fingerprint "
                f"{tokenizer.fingerprint(other)} but the student's is "
                f"{tokenizer.fingerprint(ctx.tok)}",
                lambda url: rf"{url} \(cells .*\) has max_model_len 64, but the run's rows "
                rf"reach {longest} tokens")
    for srv, refusal in zip(servers, refusals):
      url = srv.start()
      c.teacher.endpoints = ",".join(f"{n}={url}" for n in ctx.grid.names)
      run = context.Run(configure.build(c, jax.device_count()), str(tmp_path))
      if refusal is None:
        wiring.mopd_inputs(run).scorer.close()
        continue
      with pytest.raises(ConfigError, match=refusal(url)):
        wiring.mopd_inputs(run)
  finally:
    for srv in servers:
      srv.stop()


@pytest.mark.parametrize("invariant", [True, False])
def test_a_rows_scores_do_not_depend_on_its_batch_companions(invariant):
  """A row's log-probs do not depend on which requests share its prefill: bitwise with the
  batch-invariant scoring (the default), within float rounding with one [K, b, T] block
  (the block's shape changes XLA's reductions). Nothing leaks between rows or cells."""
  import types
  bank = _bank()
  r = np.random.RandomState(3)
  req = lambda cell, n: types.SimpleNamespace(cell=cell, ids=list(r.randint(0, CFG.vocab_size, n)),
                                              top_k=0)
  row = req(1, 40)
  score = lambda reqs: serve.prefill(bank, reqs, batch_invariant=invariant)
  alone = score([row])[0][0]
  crowds = [[req(0, 33), row, req(1, 60), req(1, 9), req(2, 64)],
            [req(1, 50), req(1, 20), req(1, 33), row] + [req(c, 40) for c in (0, 2) * 3]]
  for crowd in crowds:
    got = score(crowd)[crowd.index(row)][0]
    if invariant:
      np.testing.assert_array_equal(alone, got)
    else:
      np.testing.assert_allclose(alone, got, atol=1e-5)
  by_another = types.SimpleNamespace(**{**vars(row), "cell": 0})  # another teacher: differs
  assert np.abs(alone - score([by_another])[0][0]).max() > 1e-3


def test_a_server_restarted_between_steps_is_waited_for():
  """The server stops after one batch and comes back on the same port a moment later: the
  client's retries (backoff, the replica marked down then tried again) carry the next batch
  across the gap, and its scores equal the first server's bit for bit (batch-invariant
  scoring: the second server batches the rows as they arrive, not as the first did)."""
  bank = _bank()
  first = serve.TeacherServer(bank, TOK)
  url = first.start()
  port = int(url.rsplit(":", 1)[1])
  policy = teacher_client.RetryPolicy(timeout_s=10, retries=8, backoff_s=0.1, down_s=0.05)
  scorer = teacher_client.EndpointScorer(NAMES, {n: url for n in NAMES}, policy=policy)
  second = serve.TeacherServer(bank, TOK)
  tokens, mask = _batch(seed=4)
  try:
    before = scorer(tokens, mask)
    first.stop()
    with pytest.raises(urllib.error.URLError):
      _get(url + "/health")
    restart = threading.Timer(0.5, lambda: second.start(port=port))
    restart.start()
    after = scorer(tokens, mask)
    restart.join()
  finally:
    scorer.close()
    second.stop()
  np.testing.assert_array_equal(after[mask], before[mask])


def test_every_teacher_source_answers_the_same_interface(server):
  """The in-process bank (`placement.TeacherScorer`) and the servers' client
  (`EndpointScorer`) describe themselves alike (`info()`: vocabulary, tokenizer, longest
  sequence, log-prob cap, kind) and score one probe set to the same log-probs."""
  from mopd_jax.runtime import sharding
  from mopd_jax.teachers import placement, source
  mesh = sharding.make_mesh({"data": jax.device_count()})  # the suite's simulated devices
  local = placement.TeacherScorer(server.bank, mesh, mesh,
                                  tokenizer_hash=tokenizer.fingerprint(TOK))
  remote = teacher_client.EndpointScorer(NAMES, {n: server.url for n in NAMES})
  try:
    with pytest.raises(RuntimeError, match="call check"):
      remote.info()
    remote.check(vocab_size=CFG.vocab_size, tokenizer_hash=tokenizer.fingerprint(TOK))
    a, b = local.info(), remote.info()
    assert (a.kind, b.kind) == ("colocated", "endpoint") and a.cells == b.cells == NAMES
    assert a.vocab_size == b.vocab_size == CFG.vocab_size
    assert a.tokenizer_hash == b.tokenizer_hash == tokenizer.fingerprint(TOK)
    # A server scores rows one token shorter than its max_model_len: every request asks for
    # one completion token, as vLLM counts it.
    assert a.max_sequence == CFG.max_seq_len and b.max_sequence == CFG.max_seq_len - 1
    assert b.max_logprobs == server.max_logprobs and a.max_logprobs == CFG.vocab_size
    probe = source.Probe.of({"gen/low": [TOK.encode("1+2 mod 3"), TOK.encode("#0")],
                             "agt/max": [TOK.encode("boss(x)")]})
    got_a, got_b = local.score_probe(probe), remote.score_probe(probe)
    assert set(got_a) == set(got_b) == {"gen/low", "agt/max"}
    for cell in got_a:
      for row, x, y in zip(probe.rows[cell], got_a[cell], got_b[cell]):
        assert x.shape == y.shape == (len(row),) and x[0] == y[0] == 0.0
        np.testing.assert_allclose(x, y, atol=2e-5)
    with pytest.raises(ValueError, match="does not score"):
      local.score_probe(source.Probe.of({"cod/max": [[1, 2, 3]]}))
  finally:
    remote.close()


def test_the_parity_probe_flags_a_teacher_that_is_not_the_runs(server):
  """A server scoring the run's teachers passes the probe with a gap of float rounding; the
  same teachers at temperature 1 (an engine that ignores the request's temperature) and a
  uniform teacher are flagged, naming the cells (teacher.parity_tolerance's default)."""
  from configs import base
  from mopd_jax.runtime import sharding
  from mopd_jax.tasks import get_task, views
  from mopd_jax.teachers import parity, placement
  from mopd_jax.config import schema
  assert base.get_config().teacher.parity_tolerance == 0  # the servers' dtype's default
  tol = schema.PARITY_TOLERANCE[base.get_config().teacher.server_dtype]
  mesh = sharding.make_mesh({"data": jax.device_count()})
  reference = placement.TeacherScorer(server.bank, mesh, mesh)  # the server's temperature
  exs = {n: get_task(n.split("/")[0]).generate(seed=1, n=2) for n in NAMES}
  whole = parity.probe_from_examples(exs, tok=TOK, view=views.PromptView(False))
  assert all(r[0] == TOK.bos_id and r[-1] == TOK.eos_id for rs in whole.rows.values()
             for r in rs)
  # The servers' longest row: max_model_len less the completion token a request asks.
  probe = parity.probe_from_examples(exs, tok=TOK, view=views.PromptView(False),
                                     max_len=CFG.max_seq_len - 1)
  assert max(len(r) for rs in probe.rows.values() for r in rs) == CFG.max_seq_len - 1
  remote = teacher_client.EndpointScorer(NAMES, {n: server.url for n in NAMES})
  try:
    same = parity.gaps(reference, remote, probe)
  finally:
    remote.close()
  assert set(same) == set(NAMES) and max(same.values()) < 1e-4 < tol
  parity.check(same, tol, what="the loopback server")  # passes
  hot = placement.TeacherScorer(_bank(), mesh, mesh)  # temperature 1, not 0.7
  uniform = placement.TeacherScorer(
      _bank().replace(params=jax.tree.map(jnp.zeros_like, _bank().params)), mesh, mesh)
  for other in (hot, uniform):
    gaps = parity.gaps(reference, other, probe)
    assert min(gaps.values()) > 10 * tol, gaps
    with pytest.raises(ValueError, match=r"teacher parity probe: .*gen/low: .*parity_tolerance"):
      parity.check(gaps, tol, what="a stand-in")


def test_exported_teachers_score_at_the_run_temperature_from_raw_logits(tmp_path):
  """`serve.export_teachers` folds the scoring temperature into each cell's checkpoint: an
  engine scoring its raw logits (the stand-ins' `model_scores`, as vLLM and SGLang do)
  gives the in-process teacher's log-probs at that temperature."""
  from engine_standins import model_scores
  from mopd_jax import serve as serve_cli
  from mopd_jax.io import hf
  bank = _bank()
  dirs = serve_cli.export_teachers(bank, TOK, temperature=0.5, out_dir=str(tmp_path))
  assert list(dirs) == list(NAMES) and dirs["gen/max"].endswith("gen_max")
  hot = bank.replace(params=models.with_temperature(bank.params, 0.5))
  ids = [TOK.bos_id] + TOK.encode("12+3=15")
  tokens = np.zeros((K, 1, len(ids)), np.int32)
  tokens[:, 0] = ids
  want = np.asarray(teachers.score_stratified(hot, tokens, np.ones_like(tokens, bool)))
  for k, cell in enumerate(NAMES):
    cfg, params = hf.load_checkpoint(dirs[cell], dtype="float32")
    lp, tk_lp, tk_ids = model_scores(cfg, params)(cell, ids, 3)
    np.testing.assert_allclose(lp, want[k, 0], atol=2e-5)
    assert tk_lp.shape == (len(ids), 3) and (tk_lp[1:, 0] >= tk_lp[1:, 1]).all()
