"""Scoring against teacher servers: `mopd_jax.teachers.server` or vLLM (any server speaking
`/v1/completions` with `prompt_logprobs`), and SGLang (`/generate`); mopd_jax/teachers/wire.py.

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

At start, `check` detects each server's engine (this package's server answers
`/v1/metadata`, SGLang `/get_model_info`, anything else is read as vLLM) and refuses, one
line each, what would give wrong scores or fail mid-run: another vocabulary, tokenizer or
temperature, a cell the server does not hold or shares with another cell, a model length
short of the run's rows, a refused or unreadable scoring request (see `check`). Scoring
speaks each engine's protocol: `/v1/completions` with `prompt_logprobs` (ours, vLLM) or
SGLang's native `/generate` (`mopd_jax/teachers/wire.py`). `api_key` goes with every
request as a Bearer token.
"""
from __future__ import annotations

import random
import threading
import time
from concurrent import futures
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from mopd_jax.config.endpoints import parse_endpoints, RetryPolicy, split_engine
from mopd_jax.teachers import source, wire as proto
# The transport's names, re-exported: callers catch teacher_client.TeacherUnavailable.
from mopd_jax.teachers.transport import (_NotFound, _Transient, http_json, Replicas,
                                         TeacherRequestError, TeacherUnavailable)


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


def _check_ours(url: str, cells, meta: dict, *, vocab_size: int, tokenizer_hash: str,
                temperature: Optional[float], whose: str = "the student's") -> None:
  """A `mopd_jax.teachers.server`'s metadata against the run's (see `check`); `whose`
  names the run's vocabulary and tokenizer in the errors."""
  if meta.get("vocab_size") != vocab_size:
    raise ValueError(f"teacher server {url} has vocabulary size {meta.get('vocab_size')} "
                     f"but {whose} is {vocab_size}")
  if meta.get("tokenizer_hash") != tokenizer_hash:
    raise ValueError(f"teacher server {url} has tokenizer fingerprint "
                     f"{meta.get('tokenizer_hash')} but {whose} is "
                     f"{tokenizer_hash}: the token ids would mean different things")
  if temperature is not None and meta.get("temperature") != temperature:
    raise ValueError(f"teacher server {url} scores at temperature "
                     f"{meta.get('temperature')} but mopd.teacher_temperature is "
                     f"{temperature}")
  lacking = [c for c in cells if c not in meta.get("cells", ())]
  if lacking:
    raise ValueError(f"teacher server {url} holds the cells {meta.get('cells')}, not "
                     f"{lacking} that teacher.endpoints maps to it")


class EndpointScorer:
  """Stratified batches scored by teacher servers; see the module docstring.

  `names`: the bank's cell order (the K of [K, b, T]); `endpoints`: {cell: URLs}, every name
  mapped. `top_k` > 0: every result is (log-probs, top-k log-probs [K, b, T, k], ids), as
  `placement.TeacherScorer(top_k=...)` returns. `sleep` and `seed` make the backoff
  testable."""

  def __init__(self, names: Sequence[str], endpoints: Mapping[str, Sequence[str]], *,
               policy: RetryPolicy = RetryPolicy(), top_k: int = 0, workers: int = 32,
               seed: Optional[int] = None, sleep: Callable[[float], None] = time.sleep,
               api_key: Optional[str] = None):
    self.names = tuple(names)
    endpoints = parse_endpoints(dict(endpoints))
    # Engines the URLs declare ("sglang+http://..."); the others are detected by `check`.
    self.declared = {}
    for cell, urls in endpoints.items():
      for u in urls:
        engine, url = split_engine(u)
        if engine is not None and self.declared.get(url, engine) != engine:
          raise ValueError(f"teacher.endpoints declares {url} as both "
                           f"{self.declared[url]!r} and {engine!r}")
        if engine is not None:
          self.declared[url] = engine
      endpoints[cell] = tuple(split_engine(u)[1] for u in urls)
    missing = [n for n in self.names if n not in endpoints]
    if missing:
      raise ValueError(f"teacher.endpoints maps no server to the cell(s) {missing}; every "
                       f"cell of {list(self.names)} needs one")
    self.endpoints = {n: endpoints[n] for n in self.names}
    self.policy, self.top_k, self.sleep = policy, int(top_k), sleep
    self.api_key = api_key or None
    self.replicas = Replicas(self.endpoints, policy.down_s)
    self._rng = random.Random(seed)
    self._rng_lock = threading.Lock()
    self._pool = futures.ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix="teacher-client")
    self._checked = None  # {url: metadata} once `check` has run
    # url -> "mopd" | "vllm" | "sglang" (detected by `check`; before it, every server is
    # spoken to through /v1/completions, which ours and vLLM's answer alike).
    self.engines = {}

  @property
  def urls(self) -> list:
    return list(dict.fromkeys(u for us in self.endpoints.values() for u in us))

  # --- the start-up check -------------------------------------------------------------------
  def check(self, *, vocab_size: int, tokenizer_hash: str, temperature: Optional[float] = None,
            probe: Optional[tuple] = None, max_len: int = 0, parity: bool = False,
            whose: str = "the student's", only: Optional[Sequence[str]] = None) -> dict:
    """Every server against the run's vocabulary and tokenizer (the student's, or, `whose`,
    those of the run's teachers of another tokenizer) before the first step; returns {url:
    metadata}.
    Raises ValueError, one line naming the server, the cell and both values, for: another
    vocabulary or tokenizer; a cell the server does not hold, or two cells one model of a
    vLLM server (the same `root` in `/v1/models`: `--served-model-name a b` aliases one
    model); a `max_model_len` that leaves no room for the run's longest row (`max_len`
    tokens) and its one completion token; a scoring temperature the server cannot be shown
    to apply (ours reports it; vLLM scores prompt log-probs from the raw logits, so a
    `temperature` other than 1 is accepted only where the parity probe will check it,
    `parity`); a refusal of a scoring request of `probe` ((text, ids) of the student's
    tokenizer, also checked through `/tokenize` on a vLLM server) at the run's top-k, or
    an answer out of schema (a server that does not speak `prompt_logprobs`). `only`: the
    servers of these cells (one family of teachers of several tokenizers), each checked
    against this family's tokenizer; None: every server."""
    out = {}
    try:
      for url in self.urls:
        cells = [c for c, us in self.endpoints.items() if url in us]
        if only is not None and not set(cells) & set(only):
          continue
        declared = self.declared.get(url)
        meta = self._get(url, proto.METADATA, cells) if declared in (None, "mopd") else None
        info = (self._get(url, proto.SGLANG_MODEL_INFO, cells)
                if meta is None and declared in (None, "sglang") else None)
        if declared == "mopd" and meta is None:
          raise ValueError(f"teacher server {url} is declared 'mopd' but has no "
                           f"{proto.METADATA} (not a python -m mopd_jax.serve server)")
        if declared == "sglang" and not (isinstance(info, dict) and "model_path" in info):
          raise ValueError(f"teacher server {url} is declared 'sglang' but its "
                           f"{proto.SGLANG_MODEL_INFO} does not answer with a model_path")
        if meta is not None:
          _check_ours(url, cells, meta, vocab_size=vocab_size, tokenizer_hash=tokenizer_hash,
                      temperature=temperature, whose=whose)
          self.engines[url] = "mopd"
        elif isinstance(info, dict) and "model_path" in info:
          meta = self._check_sglang(url, cells, info, temperature=temperature, parity=parity)
          self.engines[url] = "sglang"
        else:  # a vLLM-compatible server
          meta = self._check_vllm(url, cells, probe, temperature=temperature, parity=parity)
          self.engines[url] = "vllm"
        limit = int(meta.get("max_model_len") or 0)
        if max_len and limit and max_len + 1 > limit:
          raise ValueError(f"teacher server {url} (cells {cells}) has max_model_len {limit}, "
                           f"but the run's rows reach {max_len} tokens (+1 for the completion "
                           "token every scoring request asks)")
        if probe is not None:
          for cell in cells:  # one scoring request per cell, as the run sends them
            self._probe_score(url, cell, probe[1])
        out[url] = meta
    except TeacherRequestError as e:  # a refusal at start: the config's mistake, one line
      raise ValueError(str(e)) from None
    self._checked = {**(self._checked or {}), **out} if only is not None else out
    return out

  def _probe_score(self, url: str, cell: str, ids) -> None:
    path, body = self._scoring_request(url, cell, ids, top_k=self.top_k)
    answer = self._get(url, path, [cell], body=body)
    if answer is None:
      raise ValueError(f"teacher server {url} answered 404 to a scoring request for cell "
                       f"{cell!r}")
    try:
      self._read(url, answer, ids, top_k=self.top_k)
    except proto.ProtocolError as e:
      schema = ("SGLang's /generate input logprobs" if self.engines.get(url) == "sglang"
                else "vLLM's prompt_logprobs schema")
      raise ValueError(f"teacher server {url} (cell {cell!r}) does not answer scoring "
                       f"requests in {schema}: {e}") from None

  def _scoring_request(self, url: str, cell: str, ids, *, top_k: int) -> tuple:
    """(path, body) of a request scoring `ids` as `cell` in the engine's own protocol."""
    if self.engines.get(url) == "sglang":
      return proto.SGLANG_GENERATE, proto.sglang_request(ids, top_k)
    return proto.COMPLETIONS, proto.completion_request(cell, ids, top_k)

  def _read(self, url: str, answer, ids, *, top_k: int) -> tuple:
    if self.engines.get(url) == "sglang":
      return proto.read_sglang_response(answer, ids, top_k)
    return proto.read_response(answer, ids, top_k)

  def _check_sglang(self, url: str, cells, info: dict, *, temperature, parity: bool) -> dict:
    """An SGLang server (it answers /get_model_info): one model, so one cell; neither its
    tokenizer nor its scoring temperature can be read, so it is accepted only where the
    parity probe checks both (as a vLLM server without a tokenizer)."""
    if len(cells) != 1:
      raise ValueError(f"teacher server {url} is SGLang, which serves one model, but "
                       f"teacher.endpoints maps the cells {cells} to it: each cell needs its "
                       "own teacher")
    if not parity:
      raise ValueError(f"teacher server {url} is SGLang: its tokenizer and its scoring "
                       f"temperature (mopd.teacher_temperature={temperature}) cannot be "
                       "checked against the run's, so it is accepted only where the parity "
                       "probe checks them (the run must hold the teachers' params)")
    models = self._get(url, proto.MODELS, cells)
    cards = proto.model_cards(models) if models is not None else {}
    limits = [int(c.get("max_model_len") or 0) for c in cards.values()]
    return {"cells": list(cells), "engine": "sglang", "model_path": info.get("model_path"),
            "max_model_len": min((x for x in limits if x), default=0)}

  def _get(self, url: str, path: str, cells, *, body=None):
    try:
      return http_json(url + path, body, self.policy.timeout_s, api_key=self.api_key)
    except _NotFound:
      return None
    except _Transient as e:
      raise TeacherUnavailable(f"teacher server {url} (cells {cells}) does not answer: "
                               f"{e}") from None

  def _check_vllm(self, url: str, cells, probe, *, temperature, parity: bool) -> dict:
    models = self._get(url, proto.MODELS, cells)
    cards = proto.model_cards(models) if models is not None else {}
    lacking = [c for c in cells if c not in cards]
    if lacking:
      raise ValueError(f"teacher server {url} serves the models {sorted(cards)}, not "
                       f"{lacking} that teacher.endpoints maps to it (start vLLM with "
                       "--served-model-name naming the cells)")
    roots = {}
    for c in cells:
      root = cards[c].get("root")
      if root and root in roots:
        raise ValueError(f"teacher server {url} serves the cells {roots[root]!r} and {c!r} "
                         f"from one model ({root}): each cell needs its own teacher")
      roots.setdefault(root, c)
    if temperature is not None and temperature != 1.0 and not parity:
      raise ValueError(f"teacher server {url} is not mopd_jax.teachers.server: vLLM scores "
                       "prompt log-probs from the raw logits whatever the request's "
                       f"temperature, so mopd.teacher_temperature={temperature} is accepted "
                       "only where the parity probe checks it (the run must hold the "
                       "teachers' params), or serve teachers exported with the temperature "
                       "in their weights and score at 1")
    if probe is None:
      raise ValueError(f"teacher server {url} has no {proto.METADATA}; checking it needs a "
                       "probe text of the student's tokenizer")
    text, ids = probe
    try:
      got = self._get(url, "/tokenize", cells,
                      body={"model": cells[0], "prompt": text, "add_special_tokens": False})
    except TeacherRequestError:  # refused: no tokenizer (vllm serve --skip-tokenizer-init)
      got = None
    if got is None:
      # Without a tokenizer the parity probe, scoring the run's own rows against its own
      # teachers, is what vouches for the token ids.
      if not parity:
        raise ValueError(f"teacher server {url} does not tokenize (no /tokenize, or "
                         "--skip-tokenizer-init), so its token ids cannot be checked against "
                         "the student's tokenizer; it is accepted only where the parity "
                         "probe checks it (the run must hold the teachers' params)")
    elif list(got.get("tokens", ())) != list(ids):
      raise ValueError(f"teacher server {url} tokenizes the probe {text!r} as "
                       f"{got.get('tokens')} but the student's tokenizer gives {list(ids)}")
    limits = [int(cards[c].get("max_model_len") or 0) for c in cells]
    return {"cells": sorted(cards), "tokenize_probe": None if got is None else list(ids),
            "max_model_len": min((x for x in limits if x), default=0)}

  # --- scoring -----------------------------------------------------------------------------
  def score_row(self, cell: str, ids: Sequence[int]) -> tuple:
    """One row's (log-probs [n], top-k log-probs [n, k] or None, ids or None), with the
    retries of the module docstring."""
    tried, url = [], None
    for attempt in range(self.policy.retries + 1):
      if attempt:
        with self._rng_lock:
          wait = self.policy.wait_s(attempt, self._rng)
        self.sleep(wait)
      url = self.replicas.pick(cell, avoid=url)
      path, body = self._scoring_request(url, cell, ids, top_k=self.top_k)
      try:
        answer = http_json(url + path, body, self.policy.timeout_s, api_key=self.api_key)
      except _Transient as e:
        self.replicas.mark_down(url)
        tried.append(f"{url} ({e})")
        continue
      self.replicas.mark_up(url)
      try:
        return self._read(url, answer, ids, top_k=self.top_k)
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
    """What the servers are, from what `check` read: their smallest limits (the longest row
    a server scores is its `max_model_len` less the one completion token a request asks;
    a vLLM server's vocabulary and logprob cap are unknown, 0). RuntimeError before
    `check`."""
    if self._checked is None:
      raise RuntimeError("EndpointScorer.info() reads the servers' metadata: call check() "
                         "first")
    metas = list(self._checked.values())
    known = [m for m in metas if "vocab_size" in m]
    first = known[0] if known else {}
    return source.SourceInfo(
        kind="endpoint", cells=self.names, vocab_size=int(first.get("vocab_size", 0)),
        tokenizer_hash=str(first.get("tokenizer_hash", "")),
        max_sequence=min((int(m["max_model_len"]) - 1 for m in metas
                          if m.get("max_model_len")), default=0),
        max_logprobs=min((int(m["max_logprobs"]) for m in known), default=0))

  def score_probe(self, probe: source.Probe) -> dict:
    """{cell: [each probe row's log-probs]}, a request per row (with the retries of the
    module docstring)."""
    source.check_cells(probe, self.names)
    return {cell: [np.asarray(self.score_row(cell, row)[0], np.float32) for row in rows]
            for cell, rows in probe.rows.items()}

  def score_probe_replicas(self, probe: source.Probe) -> dict:
    """{(cell, url): each probe row's log-probs}: every replica of every cell scores the
    probe on its own (one try each; a replica that does not answer is TeacherUnavailable),
    so that the parity monitor compares replicas, not the round robin's pick."""
    source.check_cells(probe, self.names)
    out = {}
    for cell, rows in probe.rows.items():
      for url in self.endpoints[cell]:
        scored = []
        for row in rows:
          path, body = self._scoring_request(url, cell, row, top_k=0)
          try:
            answer = http_json(url + path, body, self.policy.timeout_s, api_key=self.api_key)
            scored.append(np.asarray(self._read(url, answer, row, top_k=0)[0], np.float32))
          except _Transient as e:
            raise TeacherUnavailable(f"teacher {cell!r} at {url} does not answer the parity "
                                     f"probe: {e}") from None
          except proto.ProtocolError as e:
            raise TeacherRequestError(f"teacher {cell!r} at {url}: {e}") from None
        out[(cell, url)] = scored
    return out

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)
