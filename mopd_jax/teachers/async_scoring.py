"""Asynchronous teacher scoring: teachers score batch k while the student samples batch k+1.

    staleness 0 (synchronous, the default):  sample(k; theta_k) -> score(k) -> train(k)
    staleness 1:                              score(k) runs while sample(k+1; theta_k) runs,
                                              then train(k) on theta_k

With staleness 1, batch k+1 is sampled by theta_k but trained on by theta_{k+1}: one update
off-policy. The MOPD loss then weights every token by the truncated importance weight
clip(pi_theta / pi_sampler, low, high) (`LossConfig.is_bounds`), computed in the train step
from the sampler's own log-probs. The overlap is real when the teachers have their own devices
(`placement.teachers = "disaggregated"`): scoring is dispatched without blocking (JAX's
asynchronous dispatch) and the host goes on to drive the sampler; co-located teachers share
the chips, so the gain there is only the host work (environment turns, verification) hidden
behind device work.

`run` is the driver; the three phases are functions the caller provides, so the same loop
serves the pipeline, the tests and the benchmark:
  sample(params, step) -> batch: host-side, stratified (tokens / input_mask [K, b, T] plus
                          whatever `train` needs, e.g. sampler log-probs);
  submit(batch) -> handle: dispatch teacher scoring, do not block;
  train(state, batch, teacher_logprobs_handle) -> (state, metrics).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax


@dataclasses.dataclass
class PhaseTimes:
  """Wall seconds per phase, summed over steps. `teacher_wait` is only the time the host
  blocked on teacher results: with overlap it drops toward 0 while `teacher` work continues
  in the background."""

  sample: float = 0.0
  teacher_wait: float = 0.0
  train: float = 0.0
  total: float = 0.0
  steps: int = 0

  def per_step(self) -> dict:
    n = max(self.steps, 1)
    return {"sample": self.sample / n, "teacher_wait": self.teacher_wait / n,
            "train": self.train / n, "step": self.total / n}


def run(state, num_steps: int, *, sample: Callable, submit: Callable, train: Callable,
        staleness: int = 0, on_step: Callable | None = None, start_step: int = 0):
  """Updates `start_step` .. `num_steps - 1`; returns (state, [metrics per step], PhaseTimes).

  `staleness` 0 is exactly the synchronous loop; 1 overlaps teacher scoring of batch k with
  sampling of batch k+1. `on_step(step, state, metrics)` is called after each update (the
  pipeline checkpoints there). A run resumed at `start_step` samples its first batch afresh
  with the restored params: the batch the interrupted run had sampled one step ahead is not
  part of the checkpoint, so with staleness 1 a resumed run is exact but not bitwise equal
  to an uninterrupted one.
  """
  if staleness not in (0, 1):
    raise ValueError(f"staleness must be 0 (synchronous) or 1 (one step stale), got "
                     f"{staleness}")
  times, history = PhaseTimes(), []
  t_start = time.perf_counter()

  def timed(field, fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    setattr(times, field, getattr(times, field) + time.perf_counter() - t)
    return out

  def wait(handle):
    return jax.block_until_ready(handle)

  pending = None  # (batch, teacher handle) sampled one step ahead
  for step in range(start_step, num_steps):
    if pending is None:
      batch = timed("sample", sample, state.params, step)
      handle = submit(batch)
    else:
      batch, handle = pending
      pending = None
    if staleness and step + 1 < num_steps:
      # Sample the next batch with the current params while the teachers score this one.
      nxt = timed("sample", sample, state.params, step + 1)
      teacher_lp = timed("teacher_wait", wait, handle)
      pending = (nxt, submit(nxt))
    else:
      teacher_lp = timed("teacher_wait", wait, handle)
    state, metrics = timed("train", train, state, batch, teacher_lp)
    metrics = jax.device_get(metrics)
    history.append(metrics)
    if on_step is not None:
      on_step(step, state, metrics)
  times.total = time.perf_counter() - t_start
  times.steps = max(num_steps - start_step, 0)
  return state, history, times
