"""The HTTP transport of the teacher client (mopd_jax/teachers/client.py): one JSON request
with its failure sorted into what is worth retrying elsewhere (`_Transient`: a timeout, no
connection, 5xx, 408, 429), a 404 (`_NotFound`) and a refusal (`TeacherRequestError`); the
error bodies every engine sends read by `wire.error_message`; and the round robin over a
cell's replicas (`Replicas`)."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Mapping, Optional, Sequence

from mopd_jax.teachers import wire as proto


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


def http_json(url: str, body: Optional[dict] = None, timeout_s: float = 60.0, *,
              api_key: Optional[str] = None):
  """GET (body None) or POST a JSON body, with `api_key` as a Bearer token when given; the
  decoded JSON answer. Raises _Transient for what is worth retrying (5xx, 408, 429, no
  connection), `_NotFound` for a 404, TeacherRequestError for any other refusal (401 and 403
  say to check the key)."""
  data = None if body is None else json.dumps(body).encode()
  headers = {"Content-Type": "application/json"}
  if api_key:
    headers["Authorization"] = f"Bearer {api_key}"
  req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                               headers=headers)
  try:
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
      raw = r.read()
  except urllib.error.HTTPError as e:
    detail = _error_message(e)
    if e.code >= 500 or e.code in (408, 429):
      raise _Transient(f"HTTP {e.code}: {detail}") from None
    if e.code == 404:
      raise _NotFound(f"HTTP 404: {detail}") from None
    if e.code in (401, 403):
      hint = ("the key teacher.api_key_env names was refused" if api_key else
              "it wants an API key: name the environment variable holding it in "
              "teacher.api_key_env")
      raise TeacherRequestError(f"{url} refused the request: HTTP {e.code}: {detail} "
                                f"({hint})") from None
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
    return proto.error_message(json.loads(e.read()))
  except Exception:  # pylint: disable=broad-except  (any unreadable error body)
    return str(e.reason)
