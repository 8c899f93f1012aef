"""The teacher server: the teacher bank in its own process, scoring over HTTP.

    python -m mopd_jax.serve --config configs/toy.py --teachers WORKDIR/teachers.json
    python -m mopd_jax.serve --config configs/qwen3_mopd.py --hf_path DIR --cell gen/max

(the command line: mopd_jax/serve.py.) One process holds the bank on its own devices (`--config.mesh.*` lays it out, as in the
trainer) and answers vLLM's OpenAI-compatible `/v1/completions` with `prompt_logprobs`
(`mopd_jax/teachers/wire.py`): the token ids of prompt + response in, the log-prob of every
given token out (with its rank and, when asked, the top-k). The request's `model` names the
cell ("gen/max"), so one server holds many cells and the trainer's client talks to it and to
a vLLM server alike (`mopd_jax/teachers/client.py`). The teachers score at the config's
`mopd.teacher_temperature`, as in the trainer.

Batching: requests that arrive while the device is busy (or within `max_wait_s` of the
first) are scored together in one prefill per length bucket (and top-k size): each
request's tokens are right-padded to the next power of two, the rows laid out [K, b, T] by
cell and scored by a `vmap` over the stacked teachers (the bank's stratified layout; b is a
power of two too, so a few shapes compile, each once, the first time a round forms it).
Right padding leaves every real position's log-prob unchanged (causal attention, padded keys
masked), so the server's log-probs equal in-process scoring within float rounding. By
default the scoring is batch-invariant (`score_cells`): a row's answer is bitwise the same
whichever requests arrived with it, so a run scored by the server is reproducible bit for
bit, a server restart included; `--batch_invariant=false` trades that for the throughput of
one [K, b, T] prefill.

Endpoints: `POST /v1/completions`; `GET /health` (200 while serving, 503 once stopping);
`GET /v1/models` (one model per cell); `GET /v1/metadata` (cells, vocabulary size, tokenizer
fingerprint, temperature, model config: what the client checks at start). A request is
accepted or refused as vLLM would (`mopd_jax/teachers/wire.py`): one prompt or several,
`model` optional, a prompt plus its one completion token within `max_model_len`, errors in
vLLM's nested body, the API key (`--api_key_env`) as `vllm serve --api-key` checks it. SIGTERM (or
SIGINT) stops accepting connections, answers every request already received, then exits.

Built on tornado: an asyncio HTTP/1.1 server with keep-alive, one event loop (no locks
around the queue) and a graceful `stop` / `close_all_connections`; the prefill runs in one
worker thread so that health checks answer while the device is busy.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import signal
import threading
import time
import uuid
from concurrent import futures
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import models
from mopd_jax.io import tokenizer as tokenizer_mod
from mopd_jax.models import logprobs
from mopd_jax.teachers import bank as teachers, wire as proto

MIN_BUCKET = 16  # the shortest padded length; longer ones are powers of two
CHUNK_SIZE = 64  # the sequence chunk of the scoring scan (`logprobs.token_stats`)


def bucket(n: int, lo: int = 1) -> int:
  """The next power of two >= max(n, lo)."""
  m = max(int(n), int(lo), 1)
  return 1 << (m - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("top_k", "chunk_size", "batch_invariant"))
def score_cells(bank: teachers.TeacherBank, tokens_KxbxT, mask_KxbxT, *, top_k: int = 0,
                chunk_size: int = 64, batch_invariant: bool = True):
  """Teacher k scores rows [k]: (log-probs [K, b, T], ranks [K, b, T], top-k log-probs
  [K, b, T, k], top-k ids); the top-k pair is None when top_k is 0. No gradient flows.

  `batch_invariant`: the b rows of each cell go through one program of shape [K, 1, T] in a
  `lax.map`, so a row's numbers are bitwise the same whatever b it was batched with (XLA's
  dot kernels block over the rows, so a [K, b, T] prefill rounds a row differently for
  different b). False scores the [K, b, T] block at once: faster on an accelerator, equal to
  within float rounding."""
  params = jax.lax.stop_gradient(bank.params)

  def one(p, t, m):
    st = logprobs.token_stats(bank.model_cfg, p, t, input_mask=m, chunk_size=chunk_size,
                              top_k=top_k, with_rank=True)
    return st.logprobs, st.rank, st.topk_logprobs, st.topk_ids

  if not batch_invariant:
    return jax.vmap(one)(params, tokens_KxbxT, mask_KxbxT)

  def row(tm):  # one row index j of every cell: [K, T] -> [K, 1, T]
    out = jax.vmap(one)(params, tm[0][:, None], tm[1][:, None])
    return jax.tree.map(lambda x: x[:, 0], out)

  per_row = jax.lax.map(row, (jnp.moveaxis(tokens_KxbxT, 1, 0), jnp.moveaxis(mask_KxbxT, 1, 0)))
  return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), per_row)


@dataclasses.dataclass
class _Request:
  cell: int
  ids: list
  top_k: int
  future: asyncio.Future


def prefill(bank: teachers.TeacherBank, requests, *, chunk_size: int = 64,
            batch_invariant: bool = True) -> list:
  """One padded prefill of `requests` (each with .cell, .ids, .top_k): per request
  (log-probs [n], ranks [n], top-k log-probs [n, k], top-k ids [n, k]) as numpy."""
  num = bank.num_teachers
  counts = np.bincount([r.cell for r in requests], minlength=num)
  b = bucket(counts.max())
  width = bucket(max(len(r.ids) for r in requests), MIN_BUCKET)
  want = max(r.top_k for r in requests)
  top_k = 0 if not want else min(bucket(want), bank.model_cfg.vocab_size)
  tokens = np.zeros((num, b, width), np.int32)
  mask = np.zeros((num, b, width), bool)
  slots, used = [], np.zeros(num, int)
  for r in requests:
    j = used[r.cell]
    used[r.cell] += 1
    tokens[r.cell, j, :len(r.ids)] = r.ids
    mask[r.cell, j, :len(r.ids)] = True
    slots.append((r.cell, j))
  lp, rank, tk_lp, tk_ids = jax.device_get(score_cells(bank, tokens, mask, top_k=top_k,
                                                       chunk_size=chunk_size,
                                                       batch_invariant=batch_invariant))
  out = []
  for r, (k, j) in zip(requests, slots):
    n = len(r.ids)
    if top_k:
      tk = (tk_lp[k, j, :n, :r.top_k], tk_ids[k, j, :n, :r.top_k])
    else:
      tk = (np.zeros((n, 0), np.float32), np.zeros((n, 0), np.int32))
    out.append((lp[k, j, :n], rank[k, j, :n]) + tk)
  return out


class TeacherServer:
  """A bank behind the HTTP endpoints of the module docstring.

  `temperature`: the scoring temperature (`mopd.teacher_temperature`), applied to the bank's
  params once. `max_batch_rows`: most requests in one round of prefills; `max_wait_s`: how
  long the first request of a round waits for company; `max_logprobs`: the largest
  `prompt_logprobs` accepted (vLLM's default is 20); `batch_invariant`: see `score_cells`;
  `api_key`: when given, every `/v1` request must carry it as `Authorization: Bearer <key>`
  (401 otherwise, as `vllm serve --api-key` answers)."""

  def __init__(self, bank: teachers.TeacherBank, tok, *, temperature: float = 1.0,
               max_batch_rows: int = 256, max_wait_s: float = 0.01, max_logprobs: int = 20,
               batch_invariant: bool = True, api_key: Optional[str] = None):
    self.bank = bank.replace(params=models.with_temperature(bank.params, temperature))
    self.tok, self.temperature = tok, float(temperature)
    self.max_batch_rows, self.max_wait_s = int(max_batch_rows), float(max_wait_s)
    self.max_logprobs, self.chunk_size = int(max_logprobs), CHUNK_SIZE
    self.batch_invariant = bool(batch_invariant)
    self.api_key = api_key or None
    self.cells = {n: i for i, n in enumerate(bank.router.names)}
    self.created = int(time.time())
    self._fingerprint = tokenizer_mod.fingerprint(tok)
    self._decoded = {}  # token id -> text, filled as answers need them
    self._loop: Optional[asyncio.AbstractEventLoop] = None
    self._stop: Optional[asyncio.Event] = None
    self._thread: Optional[threading.Thread] = None
    self.stopping = False
    self.url: Optional[str] = None

  @property
  def pending(self) -> int:
    """Requests received and queued for scoring, not yet answered."""
    return getattr(self, "_pending", 0)

  # --- what the handlers ask ---------------------------------------------------------------
  def metadata(self) -> dict:
    cfg = self.bank.model_cfg
    return {"cells": list(self.cells), "vocab_size": cfg.vocab_size,
            "tokenizer_vocab_size": self.tok.vocab_size,
            "tokenizer_hash": self._fingerprint, "temperature": self.temperature,
            "max_model_len": cfg.max_seq_len, "max_logprobs": self.max_logprobs,
            "batch_invariant": self.batch_invariant,
            "model_config": dataclasses.asdict(cfg)}

  def decode(self, token_id: int) -> str:
    """A token's text; "" for ids past the tokenizer's (a padded embedding's rows)."""
    text = self._decoded.get(token_id)
    if text is None:
      text = self.tok.decode([token_id]) if token_id < self.tok.vocab_size else ""
      self._decoded[token_id] = text
    return text

  def check(self, model: Optional[str], rows: list, k: int, *, max_tokens: int = 1) -> tuple:
    """(cell index, None) or (None, (status, message)) for a parsed request (`model` None:
    the first cell, as vLLM takes its first served model)."""
    model = next(iter(self.cells)) if model is None else model
    if model not in self.cells:
      return None, (404, f"The model `{model}` does not exist; this server holds the cells "
                         f"{list(self.cells)}")
    if max_tokens != 1:
      return None, (400, f"max_tokens must be 1: this server scores prompts and does not "
                         f"generate, got {max_tokens}")
    cfg = self.bank.model_cfg
    for ids in rows:
      if len(ids) + max_tokens > cfg.max_seq_len:
        return None, (400, f"This model's maximum context length is {cfg.max_seq_len} "
                           f"tokens. However, you requested {len(ids) + max_tokens} tokens "
                           f"({len(ids)} in the prompt, {max_tokens} in the completion)")
      bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
      if bad:
        return None, (400, f"token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
    if k > self.max_logprobs:
      return None, (400, f"prompt_logprobs={k} exceeds this server's max_logprobs "
                         f"{self.max_logprobs}")
    return self.cells[model], None

  async def submit(self, cell: int, ids: list, k: int):
    """Queues one row for the next round of prefills; its per-position arrays when scored."""
    fut = asyncio.get_running_loop().create_future()
    self._pending += 1
    try:
      await self._queue.put(_Request(cell, ids, k, fut))
      return await fut
    finally:
      self._pending -= 1

  # --- batching ----------------------------------------------------------------------------
  async def _batch_loop(self, executor):
    loop = asyncio.get_running_loop()
    while True:
      batch = [await self._queue.get()]
      if self.max_wait_s > 0:
        await asyncio.sleep(self.max_wait_s)
      while len(batch) < self.max_batch_rows and not self._queue.empty():
        batch.append(self._queue.get_nowait())
      groups = {}
      for r in batch:
        key = (bucket(len(r.ids), MIN_BUCKET), bucket(r.top_k) if r.top_k else 0)
        groups.setdefault(key, []).append(r)
      for group in groups.values():
        try:
          results = await loop.run_in_executor(
              executor, functools.partial(prefill, self.bank, group, chunk_size=self.chunk_size,
                                batch_invariant=self.batch_invariant))
        except Exception as e:  # pylint: disable=broad-except  (answered as a 500)
          for r in group:
            if not r.future.done():
              r.future.set_exception(e)
          continue
        for r, res in zip(group, results):
          if not r.future.done():
            r.future.set_result(res)

  # --- lifecycle ---------------------------------------------------------------------------
  async def _main(self, host: str, port: int, *, ready: threading.Event, signals: bool):
    import tornado.httpserver  # pylint: disable=g-import-not-at-top
    import tornado.netutil  # pylint: disable=g-import-not-at-top
    self._loop = asyncio.get_running_loop()
    self._stop, self._queue, self._pending = asyncio.Event(), asyncio.Queue(), 0
    self.stopping = False
    if signals:
      for s in (signal.SIGTERM, signal.SIGINT):
        self._loop.add_signal_handler(s, self._stop.set)
    sockets = tornado.netutil.bind_sockets(port, host)
    http = tornado.httpserver.HTTPServer(_application(self))
    http.add_sockets(sockets)
    bound = sockets[0].getsockname()
    self.url = f"http://{bound[0] if ':' not in bound[0] else '[' + bound[0] + ']'}:{bound[1]}"
    executor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
    batcher = asyncio.ensure_future(self._batch_loop(executor))
    ready.set()
    if signals:
      print(f"[serve] listening on {self.url}", flush=True)
    await self._stop.wait()
    # Graceful: no new connections, every request already received is answered.
    self.stopping = True
    http.stop()
    while self._pending:
      await asyncio.sleep(0.01)
    await http.close_all_connections()
    batcher.cancel()
    executor.shutdown(wait=True)

  def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
    """Serves from a background thread (tests, notebooks); returns the base URL."""
    if self._thread is not None:
      raise RuntimeError("the server is already running")
    ready, errors = threading.Event(), []

    def run():
      try:
        asyncio.run(self._main(host, port, ready=ready, signals=False))
      except BaseException as e:  # pylint: disable=broad-except  (re-raised by start)
        errors.append(e)
        ready.set()

    self._thread = threading.Thread(target=run, name="teacher-server", daemon=True)
    self._thread.start()
    ready.wait()
    if errors:
      self._thread = None
      raise errors[0]
    return self.url

  def stop(self, timeout_s: float = 60.0) -> None:
    """Stops a server `start`ed in the background, answering the requests already in."""
    if self._thread is None:
      return
    self._loop.call_soon_threadsafe(self._stop.set)
    self._thread.join(timeout_s)
    if self._thread.is_alive():
      raise RuntimeError(f"the teacher server did not stop within {timeout_s} s")
    self._thread = None

  def serve(self, host: str, port: int) -> None:
    """Serves in this thread until SIGTERM or SIGINT, then stops gracefully."""
    asyncio.run(self._main(host, port, ready=threading.Event(), signals=True))


def _application(server: TeacherServer):
  import tornado.web  # pylint: disable=g-import-not-at-top

  class Handler(tornado.web.RequestHandler):
    def initialize(self, server):  # pylint: disable=arguments-differ
      self.server = server

    def reply(self, body: dict, status: int = 200) -> None:
      self.set_status(status)
      self.set_header("Content-Type", "application/json")
      self.finish(json.dumps(body))

    def write_error(self, status_code, **kwargs):
      self.reply(proto.error_body(self._reason, status_code), status_code)

    def prepare(self):
      # `vllm serve --api-key`: every /v1 route needs the key; /health does not.
      key = self.server.api_key
      if (key and self.request.path.startswith("/v1") and
          self.request.headers.get("Authorization", "") != f"Bearer {key}"):
        self.reply({"error": "Unauthorized"}, 401)

  class Health(Handler):
    def get(self):
      self.set_status(503 if self.server.stopping else 200)
      self.finish()

  class Models(Handler):
    def get(self):
      s = self.server
      self.reply(proto.models_response(list(s.cells), s.created,
                                       s.bank.model_cfg.max_seq_len))

  class Metadata(Handler):
    def get(self):
      self.reply(self.server.metadata())

  class Completions(Handler):
    async def post(self):
      s = self.server
      if s.stopping:
        return self.reply(proto.error_body("the server is shutting down", 503), 503)
      try:
        model, rows, k, max_tokens = proto.read_request(
            json.loads(self.request.body or b"null"))
      except ValueError as e:  # malformed JSON or schema
        return self.reply(proto.error_body(str(e), 400), 400)
      cell, err = s.check(model, rows, k, max_tokens=max_tokens)
      if err is not None:
        return self.reply(proto.error_body(err[1], err[0]), err[0])
      scored = await asyncio.gather(*(s.submit(cell, ids, k) for ids in rows))
      entries = [proto.prompt_logprobs_entries(ids, lp, rank, topk_logprobs_TxK=tk_lp,
                                               topk_ids_TxK=tk_ids, decode=s.decode)
                 for ids, (lp, rank, tk_lp, tk_ids) in zip(rows, scored)]
      self.reply(proto.completion_response(list(s.cells)[cell], entries,
                                           request_id=f"cmpl-{uuid.uuid4().hex}",
                                           created=int(time.time()), prompt_token_ids=rows))

  args = dict(server=server)
  return tornado.web.Application([
      (proto.HEALTH, Health, args), (proto.MODELS, Models, args),
      (proto.METADATA, Metadata, args), (proto.COMPLETIONS, Completions, args)])
