"""Teacher server endpoints as the run config names them, and how a client retries them.

A leaf module (it imports nothing from mopd_jax): the config schema parses
`teacher.endpoints` and builds the `RetryPolicy` with it, and mopd_jax/teachers/client.py
sends the requests.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
  timeout_s: float = 60.0  # per request, connection included
  retries: int = 4  # tries after the first
  backoff_s: float = 0.5  # the first retry's wait; doubles each retry
  max_backoff_s: float = 8.0
  jitter: float = 0.5  # each wait is scaled by a uniform draw in [1 - jitter, 1 + jitter]
  down_s: float = 30.0  # a failed replica is skipped this long

  def __post_init__(self):
    if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0 or not (
        0 <= self.jitter <= 1) or self.down_s < 0:
      raise ValueError(f"invalid retry policy {self}")

  def wait_s(self, attempt: int, rng: random.Random) -> float:
    """The wait before retry `attempt` (1, 2, ...)."""
    base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
    return base * rng.uniform(1 - self.jitter, 1 + self.jitter)


def cell_items(name: str, text: str, form: str) -> dict:
  """{cell: value text} of a per-cell flag string (`teacher.endpoints`, `teacher.hf_paths`) "gen/low=X,gen/max=Y" (`form`: what one item
  looks like, for the error); an item without a cell or a value, or a cell named twice,
  raises."""
  out = {}
  for item in filter(None, (x.strip() for x in text.split(","))):
    cell, sep, value = item.partition("=")
    if not sep or not cell.strip() or not value.strip():
      raise ValueError(f"{name}: {item!r} is not '{form}'")
    if cell.strip() in out:
      raise ValueError(f"{name} names cell {cell.strip()!r} twice")
    out[cell.strip()] = value.strip()
  return out


# The engines a URL may declare as its prefix ("sglang+http://h:30000"); a URL without one
# is detected at start (mopd_jax/teachers/client.py `EndpointScorer.check`).
ENGINES = ("mopd", "vllm", "sglang")


def split_engine(url: str) -> tuple:
  """(the declared engine or None, the URL without its prefix) of one endpoint."""
  head, sep, rest = url.partition("+")
  if sep and head in ENGINES:
    return head, rest
  return None, url


def parse_endpoints(value) -> dict:
  """{cell: (url, ...)} from a mapping (cell -> URL or list of URLs) or the flag string
  "gen/low=http://h1:8000|http://h2:8000,gen/max=http://h3:8000" ("" = none). A URL may
  declare its engine as a prefix, kept in the URL: "sglang+http://h:30000" (`ENGINES`)."""
  if isinstance(value, str):
    value = {cell: urls.split("|") for cell, urls in
             cell_items("teacher.endpoints", value, "domain/effort=URL[|URL...]").items()}
  if not isinstance(value, Mapping):
    raise ValueError(f"teacher.endpoints must map 'domain/effort' to URLs, got {value!r}")
  out = {}
  for cell, urls in value.items():
    urls = [urls] if isinstance(urls, str) else list(urls)
    urls = tuple(u.strip().rstrip("/") for u in urls if isinstance(u, str) and u.strip())
    if not urls or not all(split_engine(u)[1].startswith(("http://", "https://"))
                           for u in urls):
      raise ValueError(f"teacher.endpoints[{cell!r}] must be http(s) URLs, each optionally "
                       f"prefixed by its engine ({'+, '.join(ENGINES)}+), got {urls!r}")
    if cell.count("/") != 1:
      raise ValueError(f"teacher.endpoints: {cell!r} is not a 'domain/effort' cell")
    out[cell] = urls
  return out
