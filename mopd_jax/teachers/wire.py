"""The scoring wire format: vLLM's OpenAI-compatible `/v1/completions` with `prompt_logprobs`.

A scoring request is a completion request whose prompt is the token ids of prompt + response,
`max_tokens` 1 and `prompt_logprobs` k; its `model` names the teacher (the cell, e.g.
"gen/max", on `mopd_jax.teachers.server`; the served model's name on a vLLM server):

    {"model": "gen/max", "prompt": [1, 17, 4, ...], "max_tokens": 1, "prompt_logprobs": 0}

The answer's `choices[0].prompt_logprobs` has one entry per prompt token: `null` at position
0 (nothing predicts the first token), then a dict mapping token-id strings to
{"logprob": float, "rank": int, "decoded_token": str}, holding the given token and the k
most likely ones (k + 1 entries when the given token is not among them). The same parser
reads our server's answers and a vLLM server's, so the trainer's client speaks to either.

Pure Python and numpy: the server, the client and the tests' stand-in share it.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

COMPLETIONS = "/v1/completions"
MODELS = "/v1/models"
HEALTH = "/health"
METADATA = "/v1/metadata"  # mopd_jax.teachers.server only: cells, vocabulary, tokenizer, model config


class ProtocolError(ValueError):
  """A request or an answer that does not follow the schema above."""


def completion_request(model: str, token_ids: Sequence[int], top_k: int = 0) -> dict:
  """The body that asks for the log-prob of every token of `token_ids` (and the top-k)."""
  return {"model": model, "prompt": [int(t) for t in token_ids], "max_tokens": 1,
          "prompt_logprobs": int(top_k), "temperature": 1.0}


def read_request(body) -> tuple:
  """(model, token ids, k) of a request body; ProtocolError naming what is wrong."""
  if not isinstance(body, dict):
    raise ProtocolError("the request body must be a JSON object")
  model, prompt = body.get("model"), body.get("prompt")
  if not isinstance(model, str) or not model:
    raise ProtocolError("'model' must name a teacher cell, e.g. \"gen/max\"")
  if (not isinstance(prompt, list) or len(prompt) < 1 or
      not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
    raise ProtocolError("'prompt' must be a non-empty list of token ids")
  k = body.get("prompt_logprobs")
  if k is None or isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ProtocolError(f"'prompt_logprobs' must be an int >= 0, got {k!r}")
  max_tokens = body.get("max_tokens", 1)
  if max_tokens not in (0, 1):
    raise ProtocolError(f"'max_tokens' must be 1: this server scores prompts and does not "
                        f"generate, got {max_tokens!r}")
  return model, list(prompt), k


def prompt_logprobs_entries(token_ids: Sequence[int], logprobs_T, rank_T, *,
                            topk_logprobs_TxK, topk_ids_TxK,
                            decode: Callable[[int], str]) -> list:
  """The `prompt_logprobs` list of one prompt from its per-position arrays (position 0 is
  `null`); `topk_*` may have zero columns."""
  out = [None]
  for t in range(1, len(token_ids)):
    entry = {}
    for j in range(topk_ids_TxK.shape[1]):
      i = int(topk_ids_TxK[t, j])
      entry[str(i)] = {"logprob": float(topk_logprobs_TxK[t, j]), "rank": j + 1,
                       "decoded_token": decode(i)}
    given = int(token_ids[t])
    entry[str(given)] = {"logprob": float(logprobs_T[t]), "rank": int(rank_T[t]),
                         "decoded_token": decode(given)}
    out.append(entry)
  return out


def completion_response(model: str, entries: list, *, request_id: str, created: int) -> dict:
  """A `/v1/completions` answer carrying `entries` as `prompt_logprobs`. No token is
  generated: `text` is "" and `usage.completion_tokens` 0."""
  n = len(entries)
  return {"id": request_id, "object": "text_completion", "created": int(created),
          "model": model,
          "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                       "stop_reason": None, "prompt_logprobs": entries}],
          "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}


def error_body(message: str, code: int) -> dict:
  """vLLM's error answer."""
  kind = {400: "BadRequestError", 404: "NotFoundError"}.get(code, "InternalServerError")
  return {"object": "error", "message": message, "type": kind, "param": None, "code": code}


def read_response(body, token_ids: Sequence[int], top_k: int = 0) -> tuple:
  """(log-probs [n] float32, top-k log-probs [n, k] float32 or None, top-k ids [n, k] int32
  or None) of an answer to `completion_request(..., token_ids, top_k)`; position 0 holds 0
  (as in `mopd_jax.models.logprobs`). ProtocolError naming the position that does not fit."""
  try:
    entries = body["choices"][0]["prompt_logprobs"]
  except (KeyError, IndexError, TypeError):
    raise ProtocolError("the answer has no choices[0].prompt_logprobs") from None
  n = len(token_ids)
  if not isinstance(entries, list) or len(entries) != n:
    got = len(entries) if isinstance(entries, list) else type(entries).__name__
    raise ProtocolError(f"prompt_logprobs has {got} entries for a prompt of {n} tokens")
  if entries[0] is not None:
    raise ProtocolError("prompt_logprobs[0] must be null (nothing predicts the first token)")
  lp = np.zeros(n, np.float32)
  tk_lp = np.zeros((n, top_k), np.float32) if top_k else None
  tk_ids = np.zeros((n, top_k), np.int32) if top_k else None
  for t in range(1, n):
    entry = entries[t]
    given = str(int(token_ids[t]))
    if not isinstance(entry, dict) or given not in entry:
      raise ProtocolError(f"prompt_logprobs[{t}] lacks the given token {given}")
    lp[t] = _logprob(entry[given], t)
    if top_k:
      ranked = sorted((_rank(v, t), int(i), _logprob(v, t)) for i, v in entry.items())
      best = [(i, x) for r, i, x in ranked if r <= top_k][:top_k]
      if len(best) < top_k:
        raise ProtocolError(f"prompt_logprobs[{t}] has {len(best)} of the top {top_k} tokens")
      tk_ids[t] = [i for i, _ in best]
      tk_lp[t] = [x for _, x in best]
  return lp, tk_lp, tk_ids


def _logprob(v, t: int) -> float:
  x = v.get("logprob") if isinstance(v, dict) else None
  if isinstance(x, bool) or not isinstance(x, (int, float)):
    raise ProtocolError(f"prompt_logprobs[{t}] has an entry without a numeric logprob: {v!r}")
  return float(x)


def _rank(v, t: int) -> int:
  r = v.get("rank") if isinstance(v, dict) else None
  if isinstance(r, bool) or not isinstance(r, int) or r < 1:
    raise ProtocolError(f"prompt_logprobs[{t}] has an entry without a rank >= 1: {v!r}")
  return r


def model_names(body) -> list:
  """The served model names of a `/v1/models` answer."""
  try:
    return [m["id"] for m in body["data"]]
  except (KeyError, TypeError):
    raise ProtocolError("the /v1/models answer has no data[].id") from None


def models_response(names: Sequence[str], created: int, max_model_len: Optional[int]) -> dict:
  return {"object": "list",
          "data": [{"id": n, "object": "model", "created": int(created),
                    "owned_by": "mopd_jax", "root": n, "parent": None,
                    "max_model_len": max_model_len} for n in names]}
