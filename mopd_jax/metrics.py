"""Scalar metrics: TensorBoard event files (tensorboardX, no TensorFlow) plus a JSONL copy
that tests and notebooks read. Only process 0 writes, so multi-host runs log once."""
from __future__ import annotations

import json
import os
from typing import Mapping

import jax


class MetricsLogger:
  def __init__(self, logdir: str, enabled: bool | None = None):
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self.logdir = logdir
    self._tb = None
    self._jsonl = None
    if self.enabled:
      os.makedirs(logdir, exist_ok=True)
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(logdir, flush_secs=10)
      self._jsonl = open(os.path.join(logdir, "metrics.jsonl"), "a")

  def scalars(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
    if not self.enabled:
      return
    clean = {f"{prefix}{k}": float(v) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for k, v in clean.items():
      self._tb.add_scalar(k, v, step)
    self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")

  def close(self) -> None:
    if self.enabled:
      self._tb.close()
      self._jsonl.close()
