"""Scalar metrics: TensorBoard event files (tensorboardX, no TensorFlow) plus a JSONL copy
that tests and notebooks read. Only process 0 writes, so multi-host runs log once.

tensorboardX writes through the OS, so both files are written to a `storage.LocalMirror` of
the log folder: the folder itself for a local workdir, a local buffer copied up to the
workdir (e.g. gs://) at every `SYNC_EVERY` calls of `scalars` and at `close`.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import jax

from mopd_jax.io import storage

SYNC_EVERY = 50  # scalars calls between copies of a remote log folder


class MetricsLogger:
  def __init__(self, logdir: str, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.logdir = logdir
    self._tb = None
    self._jsonl = None
    self._mirror = None
    self._calls = 0
    if self.enabled:
      self._mirror = storage.LocalMirror(logdir)
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(self._mirror.local, flush_secs=10)
      self._jsonl = open(os.path.join(self._mirror.local, "metrics.jsonl"),  # local: mirror
                         "a")

  def scalars(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
    if not self.enabled:
      return
    clean = {f"{prefix}{k}": float(v) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for k, v in clean.items():
      self._tb.add_scalar(k, v, step)
    self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
    self._calls += 1
    if self._mirror.remote and self._calls % SYNC_EVERY == 0:
      self._tb.flush()
      self._jsonl.flush()
      self._mirror.sync()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()
      self._mirror.close()
