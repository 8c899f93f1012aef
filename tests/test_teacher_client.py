"""The teacher client (mopd_jax/teachers/client.py) against loopback stand-ins: it reads vLLM's
`prompt_logprobs` answers (a recorded one and a stand-in answering as vLLM does,
tests/engine_standins.py), checks servers at start, and handles faults: timeouts, retries with
backoff, replica failover, a server down (one line naming cell and URL), and never hands out
a partial batch."""
import dataclasses
import json
import random
import re
import socket
import time

import numpy as np
import pytest

from engine_standins import Behaviour, fake_scores, NAMES, V, VllmStandIn
from mopd_jax.teachers import async_scoring, client as teacher_client, wire as score_protocol

# A vLLM answer in the shape vLLM 0.11's OpenAI-compatible server sends (`prompt_logprobs=2`,
# prompt ids [9, 31, 4]; written from its response schema, the values a float32 model's):
# null first, then dicts keyed by token-id strings, the given token with its own rank beside
# the top 2 (k + 1 keys when it is not among them, k when it is); the choice's `token_ids`
# and `prompt_token_ids` null unless `return_token_ids` is asked.
RECORDED = """{"id":"cmpl-8e3b2f6c1d0a4b7e9f25c6a1d3e4b5f6","object":"text_completion",
"created":1764921601,"model":"gen/max","choices":[{"index":0,"text":" the","logprobs":null,
"finish_reason":"length","stop_reason":null,"token_ids":null,"prompt_logprobs":[null,
{"31":{"logprob":-4.2519617080688477,"rank":7,"decoded_token":"ab"},
"12":{"logprob":-0.60449409484863281,"rank":1,"decoded_token":" x"},
"40":{"logprob":-1.9169883728027344,"rank":2,"decoded_token":"=="}},
{"4":{"logprob":-0.12451028823852539,"rank":1,"decoded_token":"."},
"17":{"logprob":-2.6748104095458984,"rank":2,"decoded_token":"\\n"}}],
"prompt_token_ids":null}],"service_tier":null,"system_fingerprint":null,
"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1,"prompt_tokens_details":null},
"kv_transfer_params":null}"""


def test_reads_a_recorded_vllm_answer():
  lp, tk_lp, tk_ids = score_protocol.read_response(json.loads(RECORDED), [9, 31, 4], top_k=2)
  np.testing.assert_allclose(lp, [0.0, -4.2519617080688477, -0.12451028823852539])
  np.testing.assert_array_equal(tk_ids, [[0, 0], [12, 40], [4, 17]])
  np.testing.assert_allclose(tk_lp[1:], [[-0.60449409484863281, -1.9169883728027344],
                                         [-0.12451028823852539, -2.6748104095458984]])
  with pytest.raises(score_protocol.ProtocolError, match="lacks the given token 5"):
    score_protocol.read_response(json.loads(RECORDED), [9, 31, 5])
  with pytest.raises(score_protocol.ProtocolError, match="2 entries for a prompt of 3"):
    body = json.loads(RECORDED)
    body["choices"][0]["prompt_logprobs"].pop()
    score_protocol.read_response(body, [9, 31, 4])


@pytest.fixture
def standin():
  servers = []

  def make(**kw):
    s = VllmStandIn(Behaviour(**kw))
    servers.append(s)
    return s
  yield make
  for s in servers:
    s.close()


def dead_url():
  """A loopback port nobody listens on (connections are refused)."""
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()
  return f"http://127.0.0.1:{port}"


def batch(seed=0, b=3, t=10):
  r = np.random.RandomState(seed)
  tokens = r.randint(0, V, (len(NAMES), b, t)).astype(np.int32)
  lengths = r.randint(1, t + 1, (len(NAMES), b))
  lengths[0, -1] = 0  # a padding row: no request
  return tokens, np.arange(t) < lengths[..., None]


def expected(tokens, mask, k=0):
  lp = np.zeros(tokens.shape, np.float32)
  tk_lp = np.zeros(tokens.shape + (k,), np.float32)
  tk_ids = np.zeros(tokens.shape + (k,), np.int32)
  for c in range(tokens.shape[0]):
    for j in range(tokens.shape[1]):
      n = int(mask[c, j].sum())
      if n:
        a, b_, d = fake_scores(NAMES[c], tokens[c, j, :n].tolist(), k)
        lp[c, j, :n], tk_lp[c, j, :n], tk_ids[c, j, :n] = a, b_, d
  return lp, tk_lp, tk_ids


def assert_scores(got, tokens, mask, k):
  """A scorer's answer for the stratified batch equals the stand-ins' scores (and top-k)."""
  lp, tk_lp, tk_ids = expected(tokens, mask, k)
  if k:
    got, got_tk_lp, got_tk_ids = got
    np.testing.assert_array_equal(got_tk_ids, tk_ids)
    np.testing.assert_allclose(got_tk_lp, tk_lp, atol=1e-7)
  np.testing.assert_allclose(got, lp, atol=1e-7)


FAST = teacher_client.RetryPolicy(timeout_s=5.0, retries=3, backoff_s=0.01, down_s=60)


@pytest.mark.parametrize("k", [0, 3])
def test_reads_vllm_answers_stratified(standin, k):
  s = standin()
  scorer = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES}, top_k=k)
  tokens, mask = batch()
  assert_scores(scorer(tokens, mask), tokens, mask, k)
  assert s.b.requests == int((mask.sum(-1) > 0).sum())  # one request per real row
  scorer.close()


def test_parse_endpoints():
  assert teacher_client.parse_endpoints("gen/low=http://a:1|http://b:2/, gen/max=http://c:3") == {
      "gen/low": ("http://a:1", "http://b:2"), "gen/max": ("http://c:3",)}
  assert teacher_client.parse_endpoints("") == {}
  for bad, msg in [("gen/low", "not 'domain/effort=URL"), ("gen=http://a", "not a 'domain"),
                   ("gen/low=ftp://a", "http"), ("gen/low=http://a,gen/low=http://b", "twice")]:
    with pytest.raises(ValueError, match=msg):
      teacher_client.parse_endpoints(bad)
  with pytest.raises(ValueError, match=r"no server to the cell\(s\) \['gen/max'\]"):
    teacher_client.EndpointScorer(NAMES, {"gen/low": "http://a:1"})


def test_check_refuses_other_vocabulary_or_tokenizer(standin):
  good = {"cells": list(NAMES), "vocab_size": V, "tokenizer_hash": "abc", "temperature": 1.0}
  s = standin(metadata=good)
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES})
  assert sc.check(vocab_size=V, tokenizer_hash="abc", temperature=1.0)[s.url] == good
  with pytest.raises(ValueError, match=rf"{s.url} has vocabulary size {V} but the student's "
                     "is 64"):
    sc.check(vocab_size=64, tokenizer_hash="abc")
  with pytest.raises(ValueError, match="fingerprint abc but the student's is xyz"):
    sc.check(vocab_size=V, tokenizer_hash="xyz")
  with pytest.raises(ValueError, match="temperature 1.0 but mopd.teacher_temperature is 0.7"):
    sc.check(vocab_size=V, tokenizer_hash="abc", temperature=0.7)
  s2 = standin(metadata={**good, "cells": ["gen/low"]})
  sc2 = teacher_client.EndpointScorer(NAMES, {n: s2.url for n in NAMES})
  with pytest.raises(ValueError, match=r"not \['gen/max'\]"):
    sc2.check(vocab_size=V, tokenizer_hash="abc")


def test_check_of_a_vllm_server_tokenizes_a_probe(standin):
  s = standin(tokenize=[5, 6, 7])
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES})
  sc.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]))
  with pytest.raises(ValueError, match=r"as \[5, 6, 7\] but the student's tokenizer gives "
                     r"\[5, 6, 8\]"):
    sc.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 8]))
  s2 = standin(tokenize=[5, 6, 7], served=("Qwen/Qwen3-8B",))
  with pytest.raises(ValueError, match="--served-model-name"):
    teacher_client.EndpointScorer(NAMES, {n: s2.url for n in NAMES}).check(
        vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]))


def test_retries_with_exponential_backoff_and_jitter(standin):
  s = standin(fail_first=2)
  waits = []
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES}, policy=dataclasses.replace(
      FAST, backoff_s=1.0, down_s=0), sleep=waits.append, seed=0, workers=1)
  lp, _, _ = sc.score_row("gen/max", [1, 2, 3])
  np.testing.assert_allclose(lp, fake_scores("gen/max", [1, 2, 3], 0)[0])
  assert s.b.requests == 3 and len(waits) == 2
  assert 0.5 <= waits[0] <= 1.5 and 1.0 <= waits[1] <= 3.0  # 1 s then 2 s, +-50 % jitter
  pol = teacher_client.RetryPolicy(backoff_s=1.0, max_backoff_s=4.0, jitter=0.0)
  assert [pol.wait_s(a, random.Random(0)) for a in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 4]


def test_timeout_then_one_line_error(standin):
  s = standin(delay_s=1.0)
  waits = []
  sc = teacher_client.EndpointScorer(
      NAMES, {n: s.url for n in NAMES}, sleep=waits.append,
      policy=dataclasses.replace(FAST, timeout_s=0.2, retries=1))
  t0 = time.perf_counter()
  with pytest.raises(teacher_client.TeacherUnavailable) as e:
    sc.score_row("gen/low", [1, 2])
  assert time.perf_counter() - t0 < 1.0  # gave up on the timeouts, not the slow answers
  msg = str(e.value)
  assert "\n" not in msg and "'gen/low'" in msg and s.url in msg and "timed out" in msg
  assert len(waits) == 1


def test_replica_failover(standin):
  good, dead = standin(), dead_url()
  sc = teacher_client.EndpointScorer(NAMES, {n: [dead, good.url] for n in NAMES}, policy=FAST,
                                     sleep=lambda s: None, workers=1)
  tokens, mask = batch(seed=2)
  np.testing.assert_allclose(sc(tokens, mask), expected(tokens, mask)[0], atol=1e-7)
  assert sc.replicas.is_down(dead) and not sc.replicas.is_down(good.url)
  assert good.b.requests == int((mask.sum(-1) > 0).sum())  # each row answered once


def test_server_down_stops_the_run_without_training(standin):
  dead = dead_url()
  sc = teacher_client.EndpointScorer(NAMES, {n: dead for n in NAMES}, sleep=lambda s: None,
                                     policy=dataclasses.replace(FAST, retries=2))
  tokens, mask = batch()
  trained = []

  @dataclasses.dataclass
  class State:
    params: int = 0

  with pytest.raises(teacher_client.TeacherUnavailable) as e:
    async_scoring.run(State(), 2, sample=lambda p, step: (tokens, mask),
                      submit=lambda b: sc.submit(*b),
                      train=lambda st, b, h: trained.append(sc.fetch(h)) or (st, {}))
  assert trained == []  # no step saw a partial (or zero-filled) batch
  msg = str(e.value)
  assert "\n" not in msg and dead in msg and "unavailable after 3 tries" in msg
  assert any(f"'{n}'" in msg for n in NAMES)


def test_refusal_is_not_retried(standin):
  s = standin(status=400)
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES}, policy=FAST,
                                     sleep=lambda s: None)
  with pytest.raises(teacher_client.TeacherRequestError, match="HTTP 400: stand-in 400"):
    sc.score_row("gen/low", [1, 2])
  assert s.b.requests == 1


@pytest.mark.parametrize("staleness", [0, 1])
def test_async_scoring_overlaps_requests_with_sampling(standin, staleness):
  s = standin(delay_s=0.05)
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES})
  batches = [batch(seed=i) for i in range(3)]
  seen = []

  @dataclasses.dataclass
  class State:
    params: int = 0

  def train(st, b, h):
    seen.append((b, sc.fetch(h)))
    return State(st.params + 1), {}

  state, _, times = async_scoring.run(State(), 3, sample=lambda p, step: batches[step],
                                      submit=lambda b: sc.submit(*b), train=train,
                                      staleness=staleness)
  assert state.params == 3 and times.steps == 3
  for (tokens, mask), got in seen:
    np.testing.assert_allclose(got, expected(tokens, mask)[0], atol=1e-7)


# --- vLLM as it behaves (tests/engine_standins.py) -----------------------------------------
def _vllm_check(s, *, top_k=0, api_key=None, **kw):
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES}, policy=FAST,
                                     top_k=top_k, api_key=api_key, sleep=lambda s: None)
  try:
    return sc.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]), **kw)
  finally:
    sc.close()


def test_an_api_key_is_sent_as_a_bearer_token(standin):
  s = standin(tokenize=[5, 6, 7], api_key="s3cret")
  with pytest.raises(ValueError, match=r"HTTP 401: Unauthorized \(it wants an API key: name "
                     r"the environment variable holding it in teacher.api_key_env\)"):
    _vllm_check(s)
  with pytest.raises(ValueError, match="HTTP 401: Unauthorized .the key teacher.api_key_env "
                     "names was refused"):
    _vllm_check(s, api_key="wrong")
  assert _vllm_check(s, api_key="s3cret")[s.url]["cells"] == sorted(NAMES)
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES}, api_key="s3cret")
  tokens, mask = batch()
  np.testing.assert_allclose(sc(tokens, mask), expected(tokens, mask)[0], atol=1e-7)
  sc.close()


def test_two_cells_served_by_one_model_are_refused(standin):
  s = standin(tokenize=[5, 6, 7], roots={"gen/low": "/m/qwen", "gen/max": "/m/qwen"})
  with pytest.raises(ValueError, match=r"serves the cells 'gen/low' and 'gen/max' from one "
                     r"model \(/m/qwen\)"):
    _vllm_check(s)


def test_max_model_len_and_the_logprob_cap_are_checked_at_start(standin):
  s = standin(tokenize=[5, 6, 7], max_model_len=64)
  assert _vllm_check(s, max_len=63)[s.url]["max_model_len"] == 64
  with pytest.raises(ValueError, match=r"max_model_len 64, but the run's rows reach 64 tokens"):
    _vllm_check(s, max_len=64)
  s2 = standin(tokenize=[5, 6, 7], max_logprobs=5)
  _vllm_check(s2, top_k=5)
  with pytest.raises(ValueError, match="HTTP 400: Requested prompt logprobs of 8, which is "
                     "greater than max allowed: 5"):
    _vllm_check(s2, top_k=8)


def test_a_scoring_temperature_is_accepted_only_where_the_parity_probe_checks_it(standin):
  s = standin(tokenize=[5, 6, 7])
  _vllm_check(s, temperature=1.0)
  with pytest.raises(ValueError, match="raw logits whatever the request's temperature, so "
                     "mopd.teacher_temperature=0.5 is accepted only where the parity probe"):
    _vllm_check(s, temperature=0.5)
  _vllm_check(s, temperature=0.5, parity=True)  # the probe, after this check, decides


def test_a_server_without_prompt_logprobs_is_refused_at_start(standin):
  """An OpenAI-compatible server that ignores prompt_logprobs (SGLang's /v1/completions)
  passes the model and tokenizer checks; the scoring request at start catches it."""
  s = standin(tokenize=[5, 6, 7], no_prompt_logprobs=True)
  with pytest.raises(ValueError, match=r"does not answer scoring requests in vLLM's "
                     r"prompt_logprobs schema: the answer has no choices\[0\].prompt_logprobs"):
    _vllm_check(s)


def test_early_v1_null_prompt_logprobs_and_error_bodies(standin):
  s = standin(tokenize=[5, 6, 7], null_k0=True)
  _vllm_check(s)  # the client asks for the top-1 at least
  assert {b["prompt_logprobs"] for b in s.b.bodies} == {1}
  with pytest.raises(score_protocol.ProtocolError, match="early vLLM V1 answers null"):
    score_protocol.read_response({"choices": [{"prompt_logprobs": None}]}, [1, 2])
  flat = standin(status=400, flat_errors=True)
  with pytest.raises(teacher_client.TeacherRequestError, match="HTTP 400: stand-in 400"):
    teacher_client.EndpointScorer(NAMES, {n: flat.url for n in NAMES}).score_row("gen/low", [1])
  msg = score_protocol.error_message
  assert msg({"error": {"message": "a", "type": "BadRequestError", "code": 400}}) == "a"
  assert msg({"object": "error", "message": "b", "code": 400}) == "b"
  assert msg({"error": "Unauthorized"}) == "Unauthorized"
  assert msg({"detail": "Not Found"}) == "Not Found"
  unknown = standin(served=("other",))
  with pytest.raises(teacher_client.TeacherRequestError, match="HTTP 404: The model `gen/low` "
                     "does not exist"):
    teacher_client.EndpointScorer(NAMES, {n: unknown.url for n in NAMES}).score_row(
        "gen/low", [1, 2])
  assert unknown.b.requests == 1  # a refusal is not retried


# --- the parity monitor during a run (mopd_jax/teachers/parity.py) ---------------------------
def test_the_parity_monitor_catches_a_drifting_replica(standin):
  """Every replica is probed on its own: a replica whose log-probs move mid-run is caught at
  the next probe even when the cell's other replica still scores as the reference."""
  from mopd_jax.teachers import parity, source
  good, drifting = standin(), standin()
  sc = teacher_client.EndpointScorer(NAMES, {"gen/low": good.url,
                                             "gen/max": [good.url, drifting.url]}, policy=FAST)
  probe = source.Probe.of({n: [[1, 4, 9, 16], [2, 3]] for n in NAMES})
  first = sc.score_probe_replicas(probe)
  assert set(first) == {("gen/low", good.url), ("gen/max", good.url),
                        ("gen/max", drifting.url)}
  reference = {n: first[(n, good.url)] for n in NAMES}
  monitor = parity.Monitor(probe, reference, tolerance=0.01, every=2)
  assert [s for s in range(6) if monitor.due(s)] == [1, 3, 5]
  assert monitor.measure(sc) == {"gen/low": 0.0, "gen/max": 0.0}
  monitor.check(monitor.measure(sc), step=1, what="the stand-ins")
  drifting.b.scores = lambda model, ids, k: tuple(
      x - 0.05 if i < 2 else x for i, x in enumerate(fake_scores(model, ids, k)))
  gaps = monitor.measure(sc)
  assert gaps["gen/low"] == 0.0 and gaps["gen/max"] == pytest.approx(0.05, abs=1e-6)
  with pytest.raises(parity.ParityError, match=r"after step 3 \(steps 2-3 trained on these "
                     r"scores\), teacher parity probe: the stand-ins scores the probe set "
                     r"gen/max: 0.05"):
    monitor.check(gaps, step=3, what="the stand-ins")
  sc.close()


def test_the_mopd_stage_probes_after_its_steps_and_stops_on_drift():
  """`StepRecord` (what follows each MOPD step) runs the monitor when due: the gaps go into
  the step's record and metric log, and a drift stops the run after the step is kept (the
  stage saves `latest` and prints one `teacher error:` line)."""
  import types
  from mopd_jax.stages import mopd as stage
  from mopd_jax.teachers import parity, source
  probe = source.Probe.of({"gen/low": [[1, 2, 3]]})
  scores = {"lp": [np.asarray([0.0, -1.0, -2.0], np.float32)]}

  class Scorer:
    urls = ["http://teacher"]

    def score_probe_replicas(self, p):
      assert p is probe
      return {("gen/low", "http://teacher"): scores["lp"]}

  monitor = parity.Monitor(probe, {"gen/low": list(scores["lp"])}, tolerance=0.01, every=2)
  records, logged = [], []
  inp = types.SimpleNamespace(parity_monitor=monitor, served=True, scorer=Scorer())
  dist = types.SimpleNamespace(inp=inp, last_step=None, drawn_at={})
  step_record = stage.StepRecord(
      dist, loop=types.SimpleNamespace(end_step=lambda s, st, m, record: records.append(record)),
      bar=types.SimpleNamespace(update=lambda *a, **k: None),
      log=types.SimpleNamespace(scalars=lambda step, values, prefix="": logged.append(prefix)))
  for step in range(3):
    step_record(step, f"state{step}", types.SimpleNamespace(metrics={"loss": 1.0}, cells={}))
  assert ["parity_gaps" in r for r in records] == [False, True, False]
  assert records[1]["parity_gaps"] == {"gen/low": 0.0} and records[1]["parity_gap"] == 0.0
  assert "parity_gap/" in logged
  scores["lp"] = [np.asarray([0.0, -1.5, -2.0], np.float32)]  # the server drifts
  with pytest.raises(parity.ParityError, match=r"after step 3 \(steps 2-3 trained on these "
                     r"scores\).*gen/low: 0.25"):
    step_record(3, "state3", types.SimpleNamespace(metrics={"loss": 1.0}, cells={}))
  assert records[-1]["parity_gaps"] == {"gen/low": 0.25}  # recorded before the stop
  assert step_record.latest == {"done": 4, "state": "state3"}


def test_the_report_shows_each_probe_of_a_served_run():
  from mopd_jax.teachers import parity
  assert parity.report_entries(None, [{"step": 0}]) == {} and parity.report_lines({}) == []
  start = {"tolerance": 0.01, "gaps": {"gen/low": 1e-6, "gen/max": 2e-6}}
  history = [{"step": 0}, {"step": 1, "parity_gaps": {"gen/low": 3e-6, "gen/max": 0.4}}]
  rep = parity.report_entries(start, history)
  assert rep["teacher_parity"]["probes"] == [[1, {"gen/low": 3e-6, "gen/max": 0.4}]]
  assert parity.report_lines(rep)[1] == (
      "Teacher parity probe, largest mean |delta log p| per token (tolerance 0.01): at start "
      "2e-06 (gen/max); after step 1 0.4 (gen/max).")


# --- SGLang through its native /generate --------------------------------------------------
@pytest.mark.parametrize("k", [0, 3])
def test_sglang_servers_are_detected_and_scored_through_generate(k):
  from engine_standins import SglangStandIn
  servers = {n: SglangStandIn(n, api_key="s3cret") for n in NAMES}
  sc = teacher_client.EndpointScorer(NAMES, {n: s.url for n, s in servers.items()}, top_k=k,
                                     api_key="s3cret", policy=FAST)
  try:
    meta = sc.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]), max_len=100,
                    parity=True)
    assert set(sc.engines.values()) == {"sglang"}
    assert meta[servers["gen/low"].url]["model_path"] == "/models/gen/low"
    tokens, mask = batch()
    assert_scores(sc(tokens, mask), tokens, mask, k)
    body = servers["gen/max"].bodies[-1]
    assert body["return_logprob"] and body["logprob_start_len"] == 0
    assert body.get("top_logprobs_num", 0) == k
  finally:
    sc.close()
    for s in servers.values():
      s.close()


def test_sglang_start_up_refusals():
  from engine_standins import SglangStandIn
  s = SglangStandIn("gen/low", max_model_len=64)
  try:
    both = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES}, policy=FAST)
    with pytest.raises(ValueError, match=r"is SGLang, which serves one model, but "
                       r"teacher.endpoints maps the cells \['gen/low', 'gen/max'\] to it"):
      both.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]), parity=True)
    one = teacher_client.EndpointScorer(("gen/low",), {"gen/low": s.url}, policy=FAST)
    with pytest.raises(ValueError, match=r"max_model_len 64, but the run's rows reach 64"):
      one.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]), max_len=64,
                parity=True)
    with pytest.raises(ValueError, match=r"is SGLang: its tokenizer and its scoring "
                       r"temperature \(mopd.teacher_temperature=0.5\) cannot be checked"):
      one.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]), temperature=0.5)
    one.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]), temperature=0.5,
              parity=True)
    with pytest.raises(score_protocol.ProtocolError, match="no meta_info.input_token_logprobs"):
      score_protocol.read_sglang_response({"text": "!", "meta_info": {}}, [1, 2])
  finally:
    s.close()


def test_a_server_without_a_tokenizer_needs_the_parity_probe(standin):
  """vllm serve --skip-tokenizer-init (a checkpoint without a tokenizer.json, as the toy's
  character tokenizer exports): /tokenize is refused, so only the parity probe can vouch
  for its token ids."""
  s = standin(tokenize=None)
  with pytest.raises(ValueError, match="does not tokenize .* accepted only where the parity "
                     "probe checks it"):
    _vllm_check(s)
  assert _vllm_check(s, parity=True)[s.url]["tokenize_probe"] is None


def test_an_endpoint_may_declare_its_engine(standin):
  """`sglang+http://...`, `vllm+http://...`, `mopd+http://...`: a declared engine is spoken
  to as declared (no detection), and a server that is not what it is declared to be is
  refused at start with one line naming the URL; requests go to the URL without its
  prefix."""
  from engine_standins import SglangStandIn
  servers = {n: SglangStandIn(n) for n in NAMES}
  vllm = standin(tokenize=[5, 6, 7])
  try:
    sc = teacher_client.EndpointScorer(
        NAMES, {n: "sglang+" + s.url for n, s in servers.items()}, policy=FAST)
    sc.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]), parity=True)
    assert set(sc.engines.values()) == {"sglang"} and all(u.startswith("http") for u in sc.urls)
    tokens, mask = batch()
    assert_scores(sc(tokens, mask), tokens, mask, 0)
    sc.close()
    for engine, what in (("mopd", "is declared 'mopd' but has no /v1/metadata"),
                         ("sglang", "is declared 'sglang' but its /get_model_info")):
      bad = teacher_client.EndpointScorer(NAMES, {n: f"{engine}+{vllm.url}" for n in NAMES},
                                          policy=FAST)
      with pytest.raises(ValueError, match=f"teacher server {re.escape(vllm.url)} {what}"):
        bad.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]))
      bad.close()
    as_vllm = teacher_client.EndpointScorer(NAMES, {n: f"vllm+{vllm.url}" for n in NAMES},
                                            policy=FAST)
    as_vllm.check(vocab_size=V, tokenizer_hash="abc", probe=("hi", [5, 6, 7]))
    assert set(as_vllm.engines.values()) == {"vllm"}
    as_vllm.close()
    with pytest.raises(ValueError, match="must be http"):
      teacher_client.EndpointScorer(NAMES, {n: "tgi+" + vllm.url for n in NAMES})
  finally:
    for s in servers.values():
      s.close()


def test_stand_ins_listen_on_the_port_they_are_given():
  """The stand-ins, like the engines, listen on the port their command line names (the
  docs' launch lines give fixed ports); 0 takes a free one."""
  from engine_standins import SglangStandIn
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  for make in (lambda p: VllmStandIn(Behaviour(port=p)), lambda p: SglangStandIn(port=p)):
    srv = make(port)
    try:
      assert srv.url == f"http://127.0.0.1:{port}"
      with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    finally:
      srv.close()
    free = make(0)
    try:
      assert int(free.url.rsplit(":", 1)[1]) > 0
    finally:
      free.close()
