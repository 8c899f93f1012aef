"""Loopback stand-ins for the serving engines a run may score against, answering as their
documented protocols do (hand-written JSON, not mopd_jax's own encoder), so that the client's
handling of each engine's behaviour is tested without the engine.

`VllmStandIn` follows vLLM V1's OpenAI-compatible server (vllm 0.10/0.11 `vllm serve`):
  * `GET /v1/models`: one card per served name with `root` (the model path: two names of one
    model share it), `parent`, `max_model_len`; no `/v1/metadata` (FastAPI's 404 body);
  * `POST /tokenize`: {"count", "max_model_len", "tokens", "token_strs"};
  * `POST /v1/completions` with `prompt_logprobs`: prompt log-probs from the raw logits
    whatever the request's `temperature`; position 0 `null`, then the given token and the
    top k (k or k + 1 keys), `-9999.0` where a log-prob is -inf, `decoded_token`; `model`
    optional (the first served name), `prompt` one id list or several (one choice each);
    400 for `stream`, `max_tokens` < 1, `prompt_logprobs` past `--max-logprobs` (default 20),
    prompt + max_tokens past `--max-model-len`; 404 for an unknown model; errors nested
    under "error" (`flat_errors=True`: the older flat body); `--api-key`: 401
    `{"error": "Unauthorized"}` on /v1 routes without the Bearer token;
  * `null_k0=True`: early V1, which answers `prompt_logprobs=0` with `null`.
Its scores are `scores(model, ids, k)`: by default `fake_scores`, a fixed function of
(model, position, token) whose top-k are the first k of a fixed top 20, as a model's are.

`SglangStandIn` follows SGLang's native API for one model (its docstring).
"""
from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
from typing import Callable, Optional

import numpy as np

V = 50
NAMES = ("gen/low", "gen/max")


def fake_scores(model, ids, k):
  """(log-probs [n], top-k log-probs [n, k], ids [n, k]): a fixed function of (model,
  position, token), the same whatever k is asked."""
  off = NAMES.index(model) if model in NAMES else 0
  n, top = len(ids), 20
  lp = np.asarray([0.0] + [-0.01 * (i + 1) - 0.1 * off - 0.001 * t
                           for t, i in enumerate(ids) if t], np.float32)
  tk_ids = np.asarray([[(t * 3 + j + off) % V for j in range(top)] for t in range(n)],
                      np.int32).reshape(n, top)
  tk_lp = np.asarray([[-0.05 * (j + 1) - 0.001 * t for j in range(top)] for t in range(n)],
                     np.float32).reshape(n, top)
  tk_ids[0], tk_lp[0] = 0, 0
  for t in range(1, n):  # a given token among the top has its top log-prob
    hit = np.flatnonzero(tk_ids[t] == ids[t])
    if hit.size:
      lp[t] = tk_lp[t, hit[0]]
  return lp, tk_lp[:, :k], tk_ids[:, :k]


class _Handler(http.server.BaseHTTPRequestHandler):
  """A quiet JSON handler; `api_key`: 401 on guarded paths without the Bearer token."""
  api_key: Optional[str] = None

  def log_message(self, *a):
    pass

  def reply(self, status, body):
    data = json.dumps(body).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def authorised(self, guarded: bool = True):
    if self.api_key and guarded and (
        self.headers.get("Authorization") != f"Bearer {self.api_key}"):
      self.reply(401, {"error": "Unauthorized"})
      return False
    return True


def _serve(handler, port: int = 0) -> tuple:
  """(server, its base URL): `handler` served from a daemon thread on loopback `port` (0: a
  free one)."""
  httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
  httpd.daemon_threads = True
  threading.Thread(target=httpd.serve_forever, daemon=True).start()
  return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@dataclasses.dataclass
class Behaviour:
  fail_first: int = 0  # answer 503 to this many completion requests first
  status: int = 0  # answer every completion request with this status (0 = normal)
  delay_s: float = 0.0
  metadata: dict = None  # None = no /v1/metadata (a vLLM server)
  tokenize: list = None  # what /tokenize answers; None: 400 (--skip-tokenizer-init)
  served: tuple = NAMES
  roots: dict = None  # served name -> its model path; None = each its own
  api_key: Optional[str] = None  # vllm serve --api-key
  max_model_len: int = 4096
  max_logprobs: int = 20
  null_k0: bool = False  # early V1: prompt_logprobs=0 answered with null
  port: int = 0  # --port (0: a free one)
  flat_errors: bool = False  # older vLLM: {"object": "error", "message": ...}
  # An OpenAI-compatible server that ignores `prompt_logprobs` (SGLang's /v1/completions):
  # its choices carry no prompt_logprobs at all.
  no_prompt_logprobs: bool = False
  scores: Callable = fake_scores
  requests: int = 0
  bodies: list = dataclasses.field(default_factory=list)  # the completion requests received


class VllmStandIn:
  """A loopback server answering as vLLM's does (the module docstring)."""

  def __init__(self, behaviour: Optional[Behaviour] = None):
    self.b = behaviour or Behaviour()
    lock, b = threading.Lock(), self.b

    def error(status, message, kind):
      if b.flat_errors:
        return {"object": "error", "message": message, "type": kind, "param": None,
                "code": status}
      return {"error": {"message": message, "type": kind, "param": None, "code": status}}

    class H(_Handler):
      api_key = b.api_key

      def do_GET(self):
        if not self.authorised(self.path.startswith("/v1")):
          return None
        if self.path == "/v1/models":
          roots = b.roots or {m: f"/models/{m.replace('/', '_')}" for m in b.served}
          return self.reply(200, {"object": "list", "data": [
              {"id": m, "object": "model", "created": 1764900000, "owned_by": "vllm",
               "root": roots[m], "parent": None, "max_model_len": b.max_model_len,
               "permission": [{"id": "modelperm-1", "object": "model_permission",
                               "created": 1764900000, "allow_create_engine": False,
                               "allow_sampling": True, "allow_logprobs": True,
                               "allow_search_indices": False, "allow_view": True,
                               "allow_fine_tuning": False, "organization": "*",
                               "group": None, "is_blocking": False}]}
              for m in b.served]})
        if self.path == "/v1/metadata" and b.metadata is not None:
          return self.reply(200, b.metadata)
        return self.reply(404, {"detail": "Not Found"})

      def do_POST(self):
        if not self.authorised(self.path.startswith("/v1")):
          return None
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
          if b.tokenize is None:  # --skip-tokenizer-init: no tokenizer to answer with
            return self.reply(400, error(400, "Unable to get tokenizer because "
                                         "skip_tokenizer_init is True", "BadRequestError"))
          return self.reply(200, {"count": len(b.tokenize), "max_model_len": b.max_model_len,
                                  "tokens": b.tokenize, "token_strs": None})
        with lock:
          b.requests += 1
          b.bodies.append(body)
          n = b.requests
        if b.delay_s:
          time.sleep(b.delay_s)
        if b.status or n <= b.fail_first:
          status = b.status or 503
          return self.reply(status, error(status, f"stand-in {status}", "BadRequestError"))
        model = body.get("model") or b.served[0]
        if model not in b.served:
          return self.reply(404, error(404, f"The model `{model}` does not exist.",
                                       "NotFoundError"))
        prompt, k = body["prompt"], body.get("prompt_logprobs")
        rows = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        max_tokens = body.get("max_tokens", 16)
        bad = None
        if body.get("stream"):
          bad = "Prompt logprobs are not supported with streaming"
        elif max_tokens < 1:
          bad = f"max_tokens must be at least 1, got {max_tokens}."
        elif k is not None and k > b.max_logprobs:
          bad = (f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                 f"{b.max_logprobs}")
        else:
          for ids in rows:
            if len(ids) + max_tokens > b.max_model_len:
              bad = (f"This model's maximum context length is {b.max_model_len} tokens. "
                     f"However, you requested {len(ids) + max_tokens} tokens "
                     f"({len(ids)} in the messages, {max_tokens} in the completion). "
                     "Please reduce the length of the messages or completion.")
        if bad:
          return self.reply(400, error(400, bad, "BadRequestError"))
        choices = []
        for i, ids in enumerate(rows):
          plp = None
          if k is not None and not (k == 0 and b.null_k0):
            lp, tk_lp, tk_ids = b.scores(model, ids, k)
            plp = [None]
            for t in range(1, len(ids)):
              entry = {str(int(x)): {"logprob": _finite(v), "rank": j + 1,
                                     "decoded_token": "?"}
                       for j, (x, v) in enumerate(zip(tk_ids[t], tk_lp[t]))}
              if str(ids[t]) not in entry:
                entry[str(ids[t])] = {"logprob": _finite(lp[t]), "rank": k + 1 + ids[t] % 5,
                                      "decoded_token": "?"}
              plp.append(entry)
          choice = {"index": i, "text": "!", "logprobs": None, "finish_reason": "length",
                    "stop_reason": None, "token_ids": None, "prompt_logprobs": plp,
                    "prompt_token_ids": None}
          if b.no_prompt_logprobs:
            del choice["prompt_logprobs"], choice["prompt_token_ids"], choice["token_ids"]
          choices.append(choice)
        tokens = sum(len(r) for r in rows)
        self.reply(200, {"id": "cmpl-1", "object": "text_completion", "created": 1764900000,
                         "model": model, "choices": choices,
                         "service_tier": None, "system_fingerprint": None,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens + len(rows),
                                   "completion_tokens": len(rows),
                                   "prompt_tokens_details": None},
                         "prompt_logprobs": None, "prompt_token_ids": None,
                         "kv_transfer_params": None})

    self.httpd, self.url = _serve(H, b.port)

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def _finite(x) -> float:
  """vLLM's JSON for a log-prob: -9999.0 in place of -inf."""
  x = float(x)
  return -9999.0 if x == float("-inf") else x


class SglangStandIn:
  """A loopback server answering as SGLang's (sglang 0.4/0.5 `launch_server`) native API
  does for one model: `GET /get_model_info` ({"model_path", "tokenizer_path",
  "is_generation", ...}); `GET /v1/models` (one card, its `max_model_len`); `POST /generate`
  with `input_ids`, `return_logprob`, `logprob_start_len`, `top_logprobs_num`:
  `meta_info.input_token_logprobs` a [logprob, token id, text] triple per input token with
  a `null` logprob first, `input_top_logprobs` lists of such triples (`null` first); its
  `/v1/completions` ignores `prompt_logprobs` (the choices carry none). `api_key`: 401
  without the Bearer token. Scores: `scores(model, ids, k)`, as `VllmStandIn`'s."""

  def __init__(self, model: str = "gen/max", *, api_key: Optional[str] = None,
               max_model_len: int = 4096, scores: Callable = fake_scores, port: int = 0):
    self.requests, self.bodies = 0, []
    self.scores = scores
    standin = self

    class H(_Handler):

      def do_GET(self):
        if not self.authorised():
          return None
        if self.path == "/get_model_info":
          return self.reply(200, {"model_path": f"/models/{model}", "tokenizer_path":
                                  f"/models/{model}", "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": "default"})
        if self.path == "/v1/models":
          return self.reply(200, {"object": "list", "data": [
              {"id": f"/models/{model}", "object": "model", "created": 1764900000,
               "owned_by": "sglang", "root": f"/models/{model}",
               "max_model_len": max_model_len}]})
        return self.reply(404, {"detail": "Not Found"})

      def do_POST(self):
        if not self.authorised():
          return None
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        standin.requests += 1
        standin.bodies.append(body)
        if self.path == "/v1/completions":  # prompt_logprobs is not an SGLang parameter
          return self.reply(200, {"id": "1", "object": "text_completion", "created": 1,
                                  "model": model, "choices": [{
                                      "index": 0, "text": "!", "logprobs": None,
                                      "finish_reason": "length", "matched_stop": None}],
                                  "usage": {"prompt_tokens": 3, "total_tokens": 4,
                                            "completion_tokens": 1}})
        if self.path != "/generate":
          return self.reply(404, {"detail": "Not Found"})
        ids, k = body["input_ids"], body.get("top_logprobs_num", 0)
        if len(ids) + body["sampling_params"].get("max_new_tokens", 128) > max_model_len:
          return self.reply(400, {"error": {"message": f"The input ({len(ids)} tokens) is "
                                            f"longer than the model's context length "
                                            f"({max_model_len} tokens).", "code": 400}})
        lp, tk_lp, tk_ids = standin.scores(model, ids, k)
        meta = {"id": "r1", "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0,
                "input_token_logprobs": [[None, ids[0], None]] + [
                    [_finite(lp[t]), ids[t], None] for t in range(1, len(ids))],
                "output_token_logprobs": [[-0.5, 7, None]]}
        if k:
          meta["input_top_logprobs"] = [None] + [
              [[_finite(x), int(i), None] for x, i in zip(tk_lp[t], tk_ids[t])]
              for t in range(1, len(ids))]
          meta["output_top_logprobs"] = [[[-0.5, 7, None]] * k]
        return self.reply(200, {"text": "!", "output_ids": [7], "meta_info": meta})

    H.api_key = api_key
    self.httpd, self.url = _serve(H, port)

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def model_scores(cfg, params) -> Callable:
  """The `scores` of a real model: every prompt position's log-prob from the raw logits
  (temperature 1, float32, as vLLM and SGLang score prompts) and its top k."""
  import jax
  import jax.numpy as jnp
  from mopd_jax import models

  @jax.jit
  def logsm(tokens):
    return jax.nn.log_softmax(models.forward(cfg, params, tokens)[0].astype(jnp.float32), -1)

  def scores(model, ids, k):
    del model
    n = len(ids)
    width = max(16, 1 << (n - 1).bit_length())  # a few shapes, each compiled once
    full = np.asarray(logsm(jnp.asarray([list(ids) + [0] * (width - n)], jnp.int32)))[:n]
    lp = np.zeros(n, np.float32)
    lp[1:] = full[np.arange(n - 1), np.asarray(ids[1:])]
    order = np.argsort(-full, axis=-1, kind="stable")[:, :k]
    tk_ids = np.zeros((n, k), np.int32)
    tk_lp = np.zeros((n, k), np.float32)
    tk_ids[1:] = order[:-1]
    tk_lp[1:] = np.take_along_axis(full, order, axis=-1)[:-1]
    return lp, tk_lp, tk_ids
  return scores


def main(argv=None) -> None:
  """Serves a Hugging Face checkpoint as the engines' command lines would, for the tests
  that launch a run against them:

      python tests/engine_standins.py vllm serve DIR --served-model-name gen/max \
          --dtype float32 --skip-tokenizer-init [--max-model-len N] [--max-logprobs 20] \
          [--api-key KEY] --port PORT
      python tests/engine_standins.py sglang --model-path DIR --served-model-name gen/max \
          [--api-key KEY] --port PORT

  Prints `listening on URL` (`--port 0`: a free port) and serves until killed."""
  import argparse
  import sys
  argv = sys.argv[1:] if argv is None else argv
  engine, rest = argv[0], argv[1:]
  p = argparse.ArgumentParser()
  if engine == "vllm":
    p.add_argument("serve")
    p.add_argument("model")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--dtype", default="auto")
  else:
    p.add_argument("--model-path", dest="model")
    p.add_argument("--served-model-name")
  p.add_argument("--api-key")
  p.add_argument("--port", type=int, default=0)
  a = p.parse_args(rest)
  from mopd_jax.io import hf
  cfg, params = hf.load_checkpoint(a.model, dtype="float32")
  scores = model_scores(cfg, params)
  if engine == "vllm":
    names = tuple(a.served_model_name or (a.model,))
    s = VllmStandIn(Behaviour(served=names, roots={n: a.model for n in names},
                              api_key=a.api_key, scores=scores,
                              max_model_len=a.max_model_len or cfg.max_seq_len,
                              max_logprobs=a.max_logprobs, port=a.port))
  else:
    s = SglangStandIn(a.served_model_name or a.model, api_key=a.api_key,
                      max_model_len=cfg.max_seq_len, scores=scores, port=a.port)
  print(f"listening on {s.url}", flush=True)
  threading.Event().wait()


if __name__ == "__main__":
  main()
