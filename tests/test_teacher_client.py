"""The teacher client (mopd_jax/teachers/client.py) against loopback stand-ins: it reads vLLM's
`prompt_logprobs` answers (a recorded one and a stand-in answering in vLLM's shape), checks
servers at start, and handles faults: timeouts, retries with backoff, replica failover, a
server down (one line naming cell and URL), and never hands out a partial batch."""
import dataclasses
import http.server
import json
import random
import socket
import threading
import time

import numpy as np
import pytest

from mopd_jax.teachers import async_scoring, client as teacher_client, wire as score_protocol

V = 50
NAMES = ("gen/low", "gen/max")

# A vLLM answer as its OpenAI-compatible server returns it (`prompt_logprobs=2`, prompt ids
# [9, 31, 4]): null first, then dicts keyed by token-id strings, the given token with its
# own rank beside the top 2.
RECORDED = """{"id":"cmpl-6a1f0c2e9b8d4c55a3f1","object":"text_completion","created":1733151010,
"model":"gen/max","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":"length",
"stop_reason":null,"prompt_logprobs":[null,
{"31":{"logprob":-4.251953125,"rank":7,"decoded_token":"ab"},
"12":{"logprob":-0.6044921875,"rank":1,"decoded_token":" x"},
"40":{"logprob":-1.9169921875,"rank":2,"decoded_token":"=="}},
{"4":{"logprob":-0.12451171875,"rank":1,"decoded_token":"."},
"17":{"logprob":-2.6748046875,"rank":2,"decoded_token":"\\n"}}]}],
"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1,"prompt_tokens_details":null},
"service_tier":null,"system_fingerprint":null,"kv_transfer_params":null}"""


def test_reads_a_recorded_vllm_answer():
  lp, tk_lp, tk_ids = score_protocol.read_response(json.loads(RECORDED), [9, 31, 4], top_k=2)
  np.testing.assert_allclose(lp, [0.0, -4.251953125, -0.12451171875])
  np.testing.assert_array_equal(tk_ids, [[0, 0], [12, 40], [4, 17]])
  np.testing.assert_allclose(tk_lp[1:], [[-0.6044921875, -1.9169921875],
                                         [-0.12451171875, -2.6748046875]])
  with pytest.raises(score_protocol.ProtocolError, match="lacks the given token 5"):
    score_protocol.read_response(json.loads(RECORDED), [9, 31, 5])
  with pytest.raises(score_protocol.ProtocolError, match="2 entries for a prompt of 3"):
    body = json.loads(RECORDED)
    body["choices"][0]["prompt_logprobs"].pop()
    score_protocol.read_response(body, [9, 31, 4])


def fake_scores(model, ids, k):
  """The stand-in's log-probs: a fixed function of (model, position, token)."""
  off = NAMES.index(model) if model in NAMES else 0
  lp = np.asarray([0.0] + [-0.01 * (i + 1) - 0.1 * off - 0.001 * t
                           for t, i in enumerate(ids) if t], np.float32)
  tk_ids = np.asarray([[(t * 3 + j + off) % V for j in range(k)] for t in range(len(ids))],
                      np.int32).reshape(len(ids), k)
  tk_lp = np.asarray([[-0.05 * (j + 1) - 0.001 * t for j in range(k)]
                      for t in range(len(ids))], np.float32).reshape(len(ids), k)
  tk_ids[0], tk_lp[0] = 0, 0
  for t in range(1, len(ids)):  # a given token among the top k has its top-k log-prob
    hit = np.flatnonzero(tk_ids[t] == ids[t])
    if hit.size:
      lp[t] = tk_lp[t, hit[0]]
  return lp, tk_lp, tk_ids


@dataclasses.dataclass
class Behaviour:
  fail_first: int = 0  # answer 503 to this many completion requests first
  status: int = 0  # answer every completion request with this status (0 = normal)
  delay_s: float = 0.0
  metadata: dict = None  # None = no /v1/metadata (a vLLM server)
  tokenize: list = None  # what /tokenize answers
  served: tuple = NAMES
  requests: int = 0


class VllmStandIn:
  """A loopback server answering like vLLM's OpenAI-compatible server (hand-written JSON, not
  mopd_jax's own encoder)."""

  def __init__(self, behaviour=None):
    self.b = behaviour or Behaviour()
    lock, b = threading.Lock(), self.b

    class H(http.server.BaseHTTPRequestHandler):
      def log_message(self, *a):
        pass

      def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_GET(self):
        if self.path == "/v1/models":
          return self.reply(200, {"object": "list", "data": [
              {"id": m, "object": "model", "created": 1733151000, "owned_by": "vllm",
               "root": "/models/x", "parent": None, "max_model_len": 4096,
               "permission": []} for m in b.served]})
        if self.path == "/v1/metadata" and b.metadata is not None:
          return self.reply(200, b.metadata)
        self.reply(404, {"detail": "Not Found"})

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
          return self.reply(200, {"count": len(b.tokenize), "max_model_len": 4096,
                                  "tokens": b.tokenize, "token_strs": None})
        with lock:
          b.requests += 1
          n = b.requests
        if b.delay_s:
          time.sleep(b.delay_s)
        if b.status or n <= b.fail_first:
          status = b.status or 503
          return self.reply(status, {"object": "error", "message": f"stand-in {status}",
                                     "type": "BadRequestError", "param": None, "code": status})
        ids, k = body["prompt"], body["prompt_logprobs"]
        lp, tk_lp, tk_ids = fake_scores(body["model"], ids, k)
        plp = [None]
        for t in range(1, len(ids)):
          entry = {str(int(i)): {"logprob": float(x), "rank": j + 1, "decoded_token": "?"}
                   for j, (i, x) in enumerate(zip(tk_ids[t], tk_lp[t]))}
          if str(ids[t]) not in entry:
            entry[str(ids[t])] = {"logprob": float(lp[t]), "rank": k + 1 + ids[t] % 5,
                                  "decoded_token": "?"}
          plp.append(entry)
        self.reply(200, {"id": "cmpl-1", "object": "text_completion", "created": 1,
                         "model": body["model"], "choices": [{
                             "index": 0, "text": "!", "logprobs": None,
                             "finish_reason": "length", "stop_reason": None,
                             "prompt_logprobs": plp}],
                         "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 1,
                                   "completion_tokens": 1, "prompt_tokens_details": None},
                         "service_tier": None, "system_fingerprint": None,
                         "kv_transfer_params": None})

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


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


FAST = teacher_client.RetryPolicy(timeout_s=5.0, retries=3, backoff_s=0.01, down_s=60)


@pytest.mark.parametrize("k", [0, 3])
def test_reads_vllm_answers_stratified(standin, k):
  s = standin()
  scorer = teacher_client.EndpointScorer(NAMES, {n: s.url for n in NAMES}, top_k=k)
  tokens, mask = batch()
  got = scorer(tokens, mask)
  lp, tk_lp, tk_ids = expected(tokens, mask, k)
  if k:
    got, got_tk_lp, got_tk_ids = got
    np.testing.assert_array_equal(got_tk_ids, tk_ids)
    np.testing.assert_allclose(got_tk_lp, tk_lp, atol=1e-7)
  np.testing.assert_allclose(got, lp, atol=1e-7)
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
