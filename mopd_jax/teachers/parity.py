"""The parity probe: do the scores a teacher source returns belong to the teacher the run
means? A fixed probe set (each cell's prompts as its teacher sees them, followed by a
reference response) is scored by a reference source (the bank in this process, at the run's
scoring temperature) and by the source under test (a teacher server), and each cell's gap,
the mean |log p_candidate - log p_reference| over the probe's scored tokens, is compared
with `teacher.parity_tolerance`. A server scoring at another temperature, serving another
checkpoint under a cell's name, or returning a uniform distribution shows up as a gap of
tenths of a nat or more, far above the float rounding of the same model (measured in
docs/teacher_server.md).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from mopd_jax.rollout import turns as rollout
from mopd_jax.teachers import source


def probe_from_examples(examples: Mapping[str, Sequence], *, tok, view, max_len: int = 0,
                        style: str = "full") -> source.Probe:
  """The probe set of `examples` ({cell "domain/effort": examples}): each example's prompt
  as the cell's teacher sees it (`view.teacher(effort)`), then its `style` reference
  response and the end-of-sequence token, cut to `max_len` tokens (0: whole; the shortest
  `SourceInfo.max_sequence` of the sources compared)."""
  rows = {}
  for cell, exs in examples.items():
    effort = cell.split("/", 1)[1]
    rows[cell] = [(rollout.encode_prompt(tok, ex, view.teacher(effort))
                   + tok.encode(ex.solutions[style]) + [tok.eos_id])[:max_len or None]
                  for ex in exs]
  return source.Probe.of(rows)


def gaps(reference: source.ScoringSource, candidate: source.ScoringSource,
         probe: source.Probe) -> dict:
  """{cell: the mean |candidate - reference| log-prob over the probe's scored tokens (every
  position after the first)}."""
  ref, got = reference.score_probe(probe), candidate.score_probe(probe)
  out = {}
  for cell in probe.rows:
    diffs = [np.abs(np.asarray(g[1:], np.float64) - np.asarray(r[1:], np.float64))
             for r, g in zip(ref[cell], got[cell])]
    out[cell] = float(np.concatenate(diffs).mean())
  return out


def check(measured: Mapping[str, float], tolerance: float, *, what: str) -> None:
  """ValueError naming every cell whose gap exceeds `tolerance` (`what`: the source under
  test, e.g. its endpoints)."""
  bad = {c: g for c, g in measured.items() if not g <= tolerance}
  if bad:
    worst = ", ".join(f"{c}: {g:.4g}" for c, g in sorted(bad.items(), key=lambda x: -x[1]))
    raise ValueError(f"teacher parity probe: {what} scores the probe set {worst} nats per "
                     f"token (mean |delta log p|) away from the run's own teachers, over "
                     f"teacher.parity_tolerance={tolerance}; it is not the teacher the run "
                     "means (another checkpoint, temperature or dtype)")
