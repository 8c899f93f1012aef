"""Scoring against teacher servers: `mopd_jax.teachers.server`, or any server speaking vLLM's
`/v1/completions` with `prompt_logprobs` (`mopd_jax/teachers/wire.py`).

`teacher.endpoints` maps each cell to one URL or several (replicas of that cell); one server
may hold many cells. `EndpointScorer` has the interface of `placement.TeacherScorer`, so the
MOPD step and `async_scoring.run` use either: `submit` sends one request per real row of a
stratified [K, b, T] batch at once (a thread pool; the server batches them into its own
prefills) and returns a handle at once; `fetch` waits for every answer and returns the
[K, b, T] log-probs (and the top-k pair when asked), 0 at padding, as numpy. The handle has
`block_until_ready`, so `async_scoring.run` times the wait on it as the teachers' and, with
staleness 1, the requests of batch k are in flight while the student samples batch k+1.

Faults: every request has a timeout; a request that times out, cannot connect or gets a 5xx
/ 408 / 429 is retried up to `RetryPolicy.retries` times with exponential backoff and jitter,
each time on the cell's next replica that is not marked down (a replica that failed is
skipped for `down_s`, or until every replica of the cell is). Past the retries `fetch` raises
`TeacherUnavailable`, one line naming the cell and the URLs tried; a step never trains on a
partial batch of scores. A 4xx other than those, or an answer out of schema, is not retried:
it is a mistake (an unknown cell, a prompt too long), raised as `TeacherRequestError`.

At start, `check` refuses a server whose vocabulary size or tokenizer fingerprint differs from
the student's (or whose temperature differs from `mopd.teacher_temperature`), naming both,
and a server that does not hold a cell mapped to it. A server without `mopd_jax.teachers.server`'s
metadata endpoint (vLLM) is checked by tokenizing a probe text through its `/tokenize`.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from mopd_jax.config.endpoints import parse_endpoints, RetryPolicy
from mopd_jax.teachers import source, wire as proto


class TeacherUnavailable(RuntimeError):
  """A cell's servers did not answer within the retry budget."""


class TeacherRequestError(RuntimeError):
  """A server refused a request (4xx) or answered out of schema: not retried."""


class _Transient(Exception):
  """A failure worth retrying elsewhere: timeout, refused connection, 5xx, 408, 429."""


class Replicas:
  """Which URL serves a cell next: round robin over its replicas not marked down; when all
  are down, the one whose mark ends first. Thread-safe."""

  def __init__(self, endpoints: Mapping[str, Sequence[str]], down_s: float,
               clock: Callable[[], float] = time.monotonic):
    self.endpoints = {c: tuple(u) for c, u in endpoints.items()}
    self.down_s, self.clock = down_s, clock
    self._down_until = {}
    self._next = {c: 0 for c in self.endpoints}
    self._lock = threading.Lock()

  def pick(self, cell: str, avoid: Optional[str] = None) -> str:
    urls = self.endpoints[cell]
    with self._lock:
      now = self.clock()
      up = [u for u in urls if self._down_until.get(u, 0) <= now]
      if avoid is not None and len(up) > 1:
        up = [u for u in up if u != avoid]
      if not up:  # every replica is marked down: the first to come back
        return min(urls, key=lambda u: self._down_until.get(u, 0))
      i = self._next[cell] % len(up)
      self._next[cell] = i + 1
      return up[i]

  def mark_down(self, url: str) -> None:
    with self._lock:
      self._down_until[url] = self.clock() + self.down_s

  def mark_up(self, url: str) -> None:
    with self._lock:
      self._down_until.pop(url, None)

  def is_down(self, url: str) -> bool:
    with self._lock:
      return self._down_until.get(url, 0) > self.clock()


class _NotFound(TeacherRequestError):
  """A 404: a path the server does not have (vLLM has no metadata endpoint), or a cell it
  does not hold."""


def http_json(url: str, body: Optional[dict] = None, timeout_s: float = 60.0):
  """GET (body None) or POST a JSON body; the decoded JSON answer. Raises _Transient for what
  is worth retrying, TeacherRequestError for a refusal, and `_NotFound` for a 404."""
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                               headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
      raw = r.read()
  except urllib.error.HTTPError as e:
    detail = _error_message(e)
    if e.code >= 500 or e.code in (408, 429):
      raise _Transient(f"HTTP {e.code}: {detail}") from None
    if e.code == 404:
      raise _NotFound(f"HTTP 404: {detail}") from None
    raise TeacherRequestError(f"{url} refused the request: HTTP {e.code}: {detail}") from None
  except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError, OSError) as e:
    reason = getattr(e, "reason", e)
    raise _Transient(f"{type(reason).__name__}: {reason}") from None
  try:
    return json.loads(raw)
  except ValueError:
    raise TeacherRequestError(f"{url} answered with something other than JSON: "
                              f"{raw[:80]!r}") from None


def _error_message(e) -> str:
  try:
    body = json.loads(e.read())
    return str(body.get("message") or body.get("error") or body)
  except Exception:  # pylint: disable=broad-except  (any unreadable error body)
    return str(e.reason)


class PendingScores:
  """The answers of one submitted batch, in flight. `block_until_ready` waits for all of them
  (what `async_scoring.run` calls); `result` assembles the arrays."""

  def __init__(self, shape, top_k: int, jobs: list):
    self.shape, self.top_k, self.jobs = shape, top_k, jobs  # jobs: [(k, j, n, future)]

  def block_until_ready(self):
    futures.wait([f for *_, f in self.jobs])
    return self

  def result(self):
    lp = np.zeros(self.shape, np.float32)
    tk_lp = np.zeros(self.shape + (self.top_k,), np.float32) if self.top_k else None
    tk_ids = np.zeros(self.shape + (self.top_k,), np.int32) if self.top_k else None
    errors = []
    for k, j, n, fut in self.jobs:
      try:
        row_lp, row_tk_lp, row_tk_ids = fut.result()
      except (TeacherUnavailable, TeacherRequestError) as e:
        errors.append(e)
        continue
      lp[k, j, :n] = row_lp
      if self.top_k:
        tk_lp[k, j, :n], tk_ids[k, j, :n] = row_tk_lp, row_tk_ids
    if errors:  # never a partial batch: the first failure, and how many rows failed
      more = f" ({len(errors) - 1} more row(s) failed)" if len(errors) > 1 else ""
      raise type(errors[0])(f"{errors[0]}{more}")
    return lp if not self.top_k else (lp, tk_lp, tk_ids)


class EndpointScorer:
  """Stratified batches scored by teacher servers; see the module docstring.

  `names`: the bank's cell order (the K of [K, b, T]); `endpoints`: {cell: URLs}, every name
  mapped. `top_k` > 0: every result is (log-probs, top-k log-probs [K, b, T, k], ids), as
  `placement.TeacherScorer(top_k=...)` returns. `sleep` and `seed` make the backoff
  testable."""

  def __init__(self, names: Sequence[str], endpoints: Mapping[str, Sequence[str]], *,
               policy: RetryPolicy = RetryPolicy(), top_k: int = 0, workers: int = 32,
               seed: Optional[int] = None, sleep: Callable[[float], None] = time.sleep):
    self.names = tuple(names)
    endpoints = parse_endpoints(dict(endpoints))
    missing = [n for n in self.names if n not in endpoints]
    if missing:
      raise ValueError(f"teacher.endpoints maps no server to the cell(s) {missing}; every "
                       f"cell of {list(self.names)} needs one")
    self.endpoints = {n: endpoints[n] for n in self.names}
    self.policy, self.top_k, self.sleep = policy, int(top_k), sleep
    self.replicas = Replicas(self.endpoints, policy.down_s)
    self._rng = random.Random(seed)
    self._rng_lock = threading.Lock()
    self._pool = futures.ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="teacher-client")
    self._checked = None  # {url: metadata} once `check` has run

  @property
  def urls(self) -> list:
    return list(dict.fromkeys(u for us in self.endpoints.values() for u in us))

  # --- the start-up check -------------------------------------------------------------------
  def check(self, *, vocab_size: int, tokenizer_hash: str, temperature: Optional[float] = None,
            probe: Optional[tuple] = None) -> dict:
    """Every server's metadata against the student's; returns {url: metadata}. Raises
    ValueError naming the server's and the student's values. `probe`: (text, ids) of the
    student's tokenizer, checked through `/tokenize` on a server without metadata."""
    out = {}
    for url in self.urls:
      cells = [c for c, us in self.endpoints.items() if url in us]
      meta = self._get(url, proto.METADATA, cells)
      if meta is None:  # not mopd_jax.teachers.server: a vLLM-compatible server
        out[url] = self._check_vllm(url, cells, probe)
        continue
      if meta.get("vocab_size") != vocab_size:
        raise ValueError(f"teacher server {url} has vocabulary size {meta.get('vocab_size')} "
                         f"but the student's is {vocab_size}")
      if meta.get("tokenizer_hash") != tokenizer_hash:
        raise ValueError(f"teacher server {url} has tokenizer fingerprint "
                         f"{meta.get('tokenizer_hash')} but the student's is "
                         f"{tokenizer_hash}: the token ids would mean different things")
      if temperature is not None and meta.get("temperature") != temperature:
        raise ValueError(f"teacher server {url} scores at temperature "
                         f"{meta.get('temperature')} but mopd.teacher_temperature is "
                         f"{temperature}")
      lacking = [c for c in cells if c not in meta.get("cells", ())]
      if lacking:
        raise ValueError(f"teacher server {url} holds the cells {meta.get('cells')}, not "
                         f"{lacking} that teacher.endpoints maps to it")
      out[url] = meta
    self._checked = out
    return out

  def _get(self, url: str, path: str, cells, *, body=None):
    try:
      return http_json(url + path, body, self.policy.timeout_s)
    except _NotFound:
      return None
    except _Transient as e:
      raise TeacherUnavailable(f"teacher server {url} (cells {cells}) does not answer: "
                               f"{e}") from None

  def _check_vllm(self, url: str, cells, probe) -> dict:
    models = self._get(url, proto.MODELS, cells)
    served = proto.model_names(models) if models is not None else []
    lacking = [c for c in cells if c not in served]
    if lacking:
      raise ValueError(f"teacher server {url} serves the models {served}, not {lacking} "
                       "that teacher.endpoints maps to it (start vLLM with "
                       "--served-model-name naming the cells)")
    if probe is None:
      raise ValueError(f"teacher server {url} has no {proto.METADATA}; checking it needs a "
                       "probe text of the student's tokenizer")
    text, ids = probe
    got = self._get(url, "/tokenize", cells,
                    body={"model": cells[0], "prompt": text, "add_special_tokens": False})
    if got is None or list(got.get("tokens", ())) != list(ids):
      raise ValueError(f"teacher server {url} tokenizes the probe {text!r} as "
                       f"{None if got is None else got.get('tokens')} but the student's "
                       f"tokenizer gives {list(ids)}")
    return {"cells": served, "tokenize_probe": list(ids)}

  # --- scoring -----------------------------------------------------------------------------
  def score_row(self, cell: str, ids: Sequence[int]) -> tuple:
    """One row's (log-probs [n], top-k log-probs [n, k] or None, ids or None), with the
    retries of the module docstring."""
    body = proto.completion_request(cell, ids, self.top_k)
    tried, url = [], None
    for attempt in range(self.policy.retries + 1):
      if attempt:
        with self._rng_lock:
          wait = self.policy.wait_s(attempt, self._rng)
        self.sleep(wait)
      url = self.replicas.pick(cell, avoid=url)
      try:
        answer = http_json(url + proto.COMPLETIONS, body, self.policy.timeout_s)
      except _Transient as e:
        self.replicas.mark_down(url)
        tried.append(f"{url} ({e})")
        continue
      self.replicas.mark_up(url)
      try:
        return proto.read_response(answer, ids, self.top_k)
      except proto.ProtocolError as e:
        raise TeacherRequestError(f"teacher {cell!r} at {url}: {e}") from None
    raise TeacherUnavailable(
        f"teacher {cell!r} unavailable after {len(tried)} tries: " + "; ".join(
            dict.fromkeys(tried)))

  def submit(self, tokens_KxbxT, input_mask_KxbxT) -> PendingScores:
    """Sends every real row (mask not all False) at once; returns without waiting."""
    tokens, mask = np.asarray(tokens_KxbxT), np.asarray(input_mask_KxbxT, bool)
    if tokens.shape[0] != len(self.names):
      raise ValueError(f"stratified batch has {tokens.shape[0]} teacher groups but "
                       f"teacher.endpoints serves {len(self.names)} cells")
    lengths = mask.sum(-1)
    jobs = []
    for k, j in zip(*np.nonzero(lengths)):
      n = int(lengths[k, j])
      if not mask[k, j, :n].all():
        raise ValueError("a row's input_mask must be a prefix (right padding): row "
                         f"({k}, {j}) has holes")
      fut = self._pool.submit(self.score_row, self.names[k], tokens[k, j, :n].tolist())
      jobs.append((int(k), int(j), n, fut))
    return PendingScores(tokens.shape, self.top_k, jobs)

  def fetch(self, pending: PendingScores):
    return pending.block_until_ready().result()

  def __call__(self, tokens_KxbxT, input_mask_KxbxT):
    return self.fetch(self.submit(tokens_KxbxT, input_mask_KxbxT))

  def score_fn(self, bank, tokens_KxbxT, input_mask_KxbxT):
    """`mopd.mopd_step`'s `score_fn`: the bank argument is unused (the servers hold it)."""
    del bank
    return self(tokens_KxbxT, input_mask_KxbxT)

  # --- the teacher-source interface (mopd_jax/teachers/source.py) ---------------------------
  def info(self) -> source.SourceInfo:
    """What the servers are, from the metadata `check` read (their smallest limits; a vLLM
    server's are unknown, 0). RuntimeError before `check`."""
    if self._checked is None:
      raise RuntimeError("EndpointScorer.info() reads the servers' metadata: call check() "
                         "first")
    metas = list(self._checked.values())
    known = [m for m in metas if "vocab_size" in m]
    first = known[0] if known else {}
    return source.SourceInfo(
        kind="endpoint", cells=self.names, vocab_size=int(first.get("vocab_size", 0)),
        tokenizer_hash=str(first.get("tokenizer_hash", "")),
        max_sequence=min((int(m["max_model_len"]) for m in known), default=0),
        max_logprobs=min((int(m["max_logprobs"]) for m in known), default=0))

  def score_probe(self, probe: source.Probe) -> dict:
    """{cell: [each probe row's log-probs]}, a request per row (with the retries of the
    module docstring)."""
    source.check_cells(probe, self.names)
    return {cell: [np.asarray(self.score_row(cell, row)[0], np.float32) for row in rows]
            for cell, rows in probe.rows.items()}

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)
