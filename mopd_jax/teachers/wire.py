"""The scoring wire format: vLLM's OpenAI-compatible `/v1/completions` with `prompt_logprobs`.

A scoring request is a completion request whose prompt is the token ids of prompt + response,
`max_tokens` 1 and `prompt_logprobs` k; its `model` names the teacher (the cell, e.g.
"gen/max", on `mopd_jax.teachers.server`; the served model's name on a vLLM server):

    {"model": "gen/max", "prompt": [1, 17, 4, ...], "max_tokens": 1, "prompt_logprobs": 1}

The answer's `choices[0].prompt_logprobs` has one entry per prompt token: `null` at position
0 (nothing predicts the first token), then a dict mapping token-id strings to
{"logprob": float, "rank": int, "decoded_token": str}, holding the given token and the k
most likely ones (k + 1 entries when the given token is not among them). The same parser
reads our server's answers and a vLLM server's, so the trainer's client speaks to either.

What vLLM accepts, `read_request` accepts: `prompt` as one list of ids or a list of such
lists (one choice each, in order), `model` omitted (the server's first model). What vLLM
refuses, it refuses: `stream`, `max_tokens` below 1, a prompt that leaves no room for the
one generated token (`len(prompt) + max_tokens > max_model_len`, checked by the server).
Errors are vLLM's current body, `{"error": {"message", "type", "param", "code"}}`;
`error_message` reads that, the flat body older vLLM versions send, and a bare string.

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
  """The body that asks for the log-prob of every token of `token_ids` (and the top-k).
  Its temperature (1) shapes only the one generated token: vLLM computes prompt log-probs
  from the raw logits whatever the request says, so a scoring temperature is the served
  model's own (checked by the parity probe, `mopd_jax/teachers/parity.py`). It asks for at
  least the top-1, as early vLLM V1 answers `prompt_logprobs=0` with null."""
  return {"model": model, "prompt": [int(t) for t in token_ids], "max_tokens": 1,
          "prompt_logprobs": max(int(top_k), 1), "temperature": 1.0}


def _is_ids(x) -> bool:
  return (isinstance(x, list) and len(x) >= 1 and
          all(isinstance(t, int) and not isinstance(t, bool) for t in x))


def read_request(body) -> tuple:
  """(model or None, [token ids of each prompt], k, max_tokens) of a request body;
  ProtocolError naming what is wrong."""
  if not isinstance(body, dict):
    raise ProtocolError("the request body must be a JSON object")
  model, prompt = body.get("model"), body.get("prompt")
  if model is not None and (not isinstance(model, str) or not model):
    raise ProtocolError("'model' must name a teacher cell, e.g. \"gen/max\"")
  if _is_ids(prompt):
    rows = [list(prompt)]
  elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
    rows = [list(p) for p in prompt]
  else:
    raise ProtocolError("'prompt' must be a non-empty list of token ids, or a list of them")
  k = body.get("prompt_logprobs")
  if k is None or isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ProtocolError(f"'prompt_logprobs' must be an int >= 0, got {k!r}")
  if body.get("stream"):
    raise ProtocolError("'stream' is not supported with prompt_logprobs")
  max_tokens = body.get("max_tokens", 1)
  if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
    raise ProtocolError(f"'max_tokens' must be an int >= 1, got {max_tokens!r}")
  return model, rows, k, max_tokens


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


def completion_response(model: str, entries: list, *, request_id: str, created: int,
                        prompt_token_ids: Optional[list] = None) -> dict:
  """A `/v1/completions` answer with one choice per prompt, choice i carrying `entries[i]`
  as its `prompt_logprobs` (and `prompt_token_ids[i]`, as current vLLM sends them). No token
  is generated: `text` is "" and `usage.completion_tokens` 0."""
  n = sum(len(e) for e in entries)
  ids = prompt_token_ids or [None] * len(entries)
  return {"id": request_id, "object": "text_completion", "created": int(created),
          "model": model,
          "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": "length",
                       "stop_reason": None, "prompt_logprobs": e, "prompt_token_ids": t}
                      for i, (e, t) in enumerate(zip(entries, ids))],
          "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                503: "ServiceUnavailableError"}


def error_body(message: str, code: int) -> dict:
  """vLLM's current error answer: the error nested under "error"."""
  return {"error": {"message": message, "type": _ERROR_TYPES.get(code, "InternalServerError"),
                    "param": None, "code": code}}


def error_message(body) -> str:
  """The message of an error answer: vLLM's nested body, the flat one of older versions
  (`{"object": "error", "message": ...}`), `{"error": "Unauthorized"}` (vLLM's API-key
  check), FastAPI's `{"detail": ...}`, or the body itself."""
  if isinstance(body, dict):
    err = body.get("error")
    if isinstance(err, dict) and err.get("message"):
      return str(err["message"])
    for key in ("message", "detail"):
      if body.get(key):
        return str(body[key])
    if err:
      return str(err)
  return str(body)


def read_response(body, token_ids: Sequence[int], top_k: int = 0) -> tuple:
  """(log-probs [n] float32, top-k log-probs [n, k] float32 or None, top-k ids [n, k] int32
  or None) of an answer to `completion_request(..., token_ids, top_k)`; position 0 holds 0
  (as in `mopd_jax.models.logprobs`). ProtocolError naming the position that does not fit."""
  try:
    entries = body["choices"][0]["prompt_logprobs"]
  except (KeyError, IndexError, TypeError):
    raise ProtocolError("the answer has no choices[0].prompt_logprobs") from None
  if entries is None:
    raise ProtocolError("choices[0].prompt_logprobs is null: the server did not score the "
                        "prompt (early vLLM V1 answers null to prompt_logprobs=0)")
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


def model_cards(body) -> dict:
  """{served model name: its card} of a `/v1/models` answer (the card's `root`, `parent`
  and `max_model_len` as vLLM sends them, when it does)."""
  names = model_names(body)
  return {n: (m if isinstance(m, dict) else {}) for n, m in zip(names, body["data"])}


def models_response(names: Sequence[str], created: int, max_model_len: Optional[int]) -> dict:
  return {"object": "list",
          "data": [{"id": n, "object": "model", "created": int(created),
                    "owned_by": "mopd_jax", "root": n, "parent": None,
                    "max_model_len": max_model_len} for n in names]}


# --- SGLang's native /generate --------------------------------------------------------------
SGLANG_GENERATE = "/generate"
SGLANG_MODEL_INFO = "/get_model_info"


def sglang_request(token_ids: Sequence[int], top_k: int = 0) -> dict:
  """SGLang's `/generate` body that scores `token_ids`: the log-prob of every input token
  from the first (`logprob_start_len` 0) and the top-k at each, one token generated."""
  body = {"input_ids": [int(t) for t in token_ids],
          "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
          "return_logprob": True, "logprob_start_len": 0}
  if top_k:
    body["top_logprobs_num"] = int(top_k)
  return body


def read_sglang_response(body, token_ids: Sequence[int], top_k: int = 0) -> tuple:
  """(log-probs [n], top-k log-probs [n, k] or None, ids [n, k] or None) of a `/generate`
  answer to `sglang_request(token_ids, top_k)`: `meta_info.input_token_logprobs` holds
  [logprob, token id, text] per input token (`null` logprob first), `input_top_logprobs`
  the top-k lists of such triples (`null` first). ProtocolError naming what does not fit."""
  try:
    meta = body["meta_info"]
    entries = meta["input_token_logprobs"]
  except (KeyError, TypeError):
    raise ProtocolError("the /generate answer has no meta_info.input_token_logprobs (was "
                        "return_logprob honoured?)") from None
  n = len(token_ids)
  if not isinstance(entries, list) or len(entries) != n:
    got = len(entries) if isinstance(entries, list) else type(entries).__name__
    raise ProtocolError(f"input_token_logprobs has {got} entries for {n} input tokens")
  lp = np.zeros(n, np.float32)
  for t in range(1, n):
    e = entries[t]
    if not isinstance(e, (list, tuple)) or len(e) < 2 or e[1] != int(token_ids[t]):
      raise ProtocolError(f"input_token_logprobs[{t}] is not [logprob, {int(token_ids[t])}, "
                          f"...]: {e!r}")
    lp[t] = _logprob({"logprob": e[0]}, t)
  if not top_k:
    return lp, None, None
  tops = meta.get("input_top_logprobs")
  if not isinstance(tops, list) or len(tops) != n:
    raise ProtocolError(f"input_top_logprobs must list the top {top_k} of each of {n} input "
                        "tokens (top_logprobs_num)")
  tk_lp, tk_ids = np.zeros((n, top_k), np.float32), np.zeros((n, top_k), np.int32)
  for t in range(1, n):
    row = tops[t]
    if not isinstance(row, list) or len(row) < top_k:
      raise ProtocolError(f"input_top_logprobs[{t}] has fewer than {top_k} entries")
    for j, e in enumerate(row[:top_k]):
      tk_lp[t, j], tk_ids[t, j] = _logprob({"logprob": e[0]}, t), int(e[1])
  return lp, tk_lp, tk_ids
