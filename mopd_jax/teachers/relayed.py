"""Teacher servers in a run of several processes: process 0 alone talks to the servers and
every other process receives what it got.

Every process holds the step's batch, but only one asks the servers: the servers see each
row once, and every process trains on the same scores (a server asked twice need not answer
bitwise alike: vLLM's batching is not batch-invariant). `Relayed` wraps the client process 0
builds (`teacher_client.EndpointScorer`, checked at start) and offers what the run calls on
it; each call is made by every process in the same order, process 0 does the work and sends
the result (arrays with `multihost_utils.broadcast_one_to_all`, the rest as JSON). An error
on process 0 (a start-up check, a server down, a row refused) is sent first, and every
process raises it with the same type and message, so no process waits on a broadcast that
never comes.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional

import numpy as np
from jax.experimental import multihost_utils

from mopd_jax.config import schema as config_mod
from mopd_jax.runtime import distributed
from mopd_jax.teachers import client as teacher_client, source

# The errors relayed by type; any other is relayed as a RuntimeError with its message.
_ERRORS = {cls.__name__: cls for cls in (
    config_mod.ConfigError, ValueError, teacher_client.TeacherUnavailable,
    teacher_client.TeacherRequestError)}


def _on_zero(fn: Callable):
  """fn()'s value on process 0 (None elsewhere); an error it raises is raised on every
  process (on process 0 itself, with its traceback)."""
  value, error, failure = None, None, None
  if distributed.is_main():
    try:
      value = fn()
    except Exception as e:  # pylint: disable=broad-except
      error, failure = e, {"type": type(e).__name__, "message": str(e)}
  failure = json.loads(distributed.broadcast_text(json.dumps(failure)))
  if error is not None:
    raise error
  if failure is not None:
    raise _ERRORS.get(failure["type"], RuntimeError)(failure["message"])
  return value


def _json(fn: Callable):
  """fn()'s JSON-able value on process 0, on every process."""
  return json.loads(distributed.broadcast_text(json.dumps(_on_zero(fn))))


class _Submitted:
  """A relayed submission: process 0's pending answers, the batch's shape everywhere."""

  def __init__(self, shape, pending=None):
    self.shape, self.pending = shape, pending

  def block_until_ready(self):
    if self.pending is not None:
      self.pending.block_until_ready()
    return self


class Relayed:
  """`make()` -> the client, called on process 0 only; the same calls as the client."""

  def __init__(self, make: Callable):
    self.client: Optional[teacher_client.EndpointScorer] = None

    def build():
      self.client = make()
      c = self.client
      return {"names": list(c.names), "endpoints": {k: list(v) for k, v in c.endpoints.items()},
              "urls": list(c.urls), "top_k": c.top_k}
    meta = _json(build)
    self.names, self.urls, self.top_k = tuple(meta["names"]), tuple(meta["urls"]), meta["top_k"]
    self.endpoints = {k: tuple(v) for k, v in meta["endpoints"].items()}

  def submit(self, tokens_KxbxT, input_mask_KxbxT) -> _Submitted:
    shape = np.asarray(tokens_KxbxT).shape
    pending = _on_zero(lambda: self.client.submit(tokens_KxbxT, input_mask_KxbxT))
    return _Submitted(shape, pending)

  def fetch(self, submitted: _Submitted):
    got = _on_zero(lambda: self.client.fetch(submitted.pending))
    if got is None:  # not process 0: zeros of the answer's shapes, to receive into
      lp = np.zeros(submitted.shape, np.float32)
      k = submitted.shape + (self.top_k,)
      got = lp if not self.top_k else (lp, np.zeros(k, np.float32), np.zeros(k, np.int32))
    return multihost_utils.broadcast_one_to_all(got)

  def __call__(self, tokens_KxbxT, input_mask_KxbxT):
    return self.fetch(self.submit(tokens_KxbxT, input_mask_KxbxT))

  def info(self) -> source.SourceInfo:
    fields = _json(lambda: dict(dataclasses.asdict(self.client.info()),
                                cells=list(self.client.names)))
    return source.SourceInfo(**{**fields, "cells": tuple(fields["cells"])})

  def score_probe(self, probe: source.Probe) -> dict:
    got = _json(lambda: {c: [np.asarray(r).tolist() for r in rows]
                         for c, rows in self.client.score_probe(probe).items()})
    return {c: [np.asarray(r, np.float32) for r in rows] for c, rows in got.items()}

  def score_probe_replicas(self, probe: source.Probe) -> dict:
    got = _json(lambda: [[c, u, [np.asarray(r).tolist() for r in rows]] for (c, u), rows in
                         self.client.score_probe_replicas(probe).items()])
    return {(c, u): [np.asarray(r, np.float32) for r in rows] for c, u, rows in got}

  def close(self) -> None:
    if self.client is not None:
      self.client.close()
