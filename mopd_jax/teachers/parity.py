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

from typing import Mapping, Optional, Sequence

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
  return score_gaps(reference.score_probe(probe), candidate.score_probe(probe))


def score_gaps(reference: Mapping[str, Sequence], candidate: Mapping[str, Sequence]) -> dict:
  """{cell: the mean |candidate - reference| over the scored tokens} of two `score_probe`
  results ({cell: [each row's log-probs]}) of one probe."""
  out = {}
  for cell, ref_rows in reference.items():
    diffs = [np.abs(np.asarray(g[1:], np.float64) - np.asarray(r[1:], np.float64))
             for r, g in zip(ref_rows, candidate[cell])]
    out[cell] = float(np.concatenate(diffs).mean())
  return out


class ParityError(RuntimeError):
  """A teacher source that drifted from the run's teachers mid-run (`Monitor.check`)."""


class Monitor:
  """The parity probe during a run: every `every` steps each replica of each cell scores
  `probe` again and is compared with `reference` ({cell: rows' log-probs}: the in-process
  teachers' at start, or, where the run holds no teacher params, the servers' own answers at
  the first probe). A replica that moved more than `tolerance` is a teacher the run no longer
  means: a server restarted on another checkpoint, a colocated engine that woke up with
  other weights."""

  def __init__(self, probe: source.Probe, reference: Mapping[str, Sequence], *,
               tolerance: float, every: int):
    self.probe, self.reference = probe, dict(reference)
    self.tolerance, self.every = float(tolerance), int(every)
    self.passed_after = None  # the step after which the last mid-run probe passed

  def due(self, step: int) -> bool:
    """Whether the probe runs after (0-based) `step`."""
    return self.every > 0 and (step + 1) % self.every == 0

  def measure(self, scorer) -> dict:
    """{cell: the largest gap over the cell's replicas}, each replica scoring the probe on
    its own (`scorer.score_probe_replicas`)."""
    return self.gaps_of(scorer.score_probe_replicas(self.probe))

  def gaps_of(self, replicas: Mapping[tuple, Sequence]) -> dict:
    """{cell: the largest gap over its replicas} of {(cell, url): rows' log-probs}."""
    out = {}
    for (cell, _), rows in replicas.items():
      gap = score_gaps({cell: self.reference[cell]}, {cell: rows})[cell]
      out[cell] = max(out.get(cell, 0.0), gap)
    return out

  def check(self, measured: Mapping[str, float], *, step: int, what: str) -> None:
    """ParityError, one line naming the drifted cells and the steps since the last passed
    probe, when a gap exceeds the tolerance."""
    try:
      check(measured, self.tolerance, what=what)
    except ValueError as e:
      since = self.passed_after + 1 if self.passed_after is not None else 0
      raise ParityError(f"after step {step} (steps {since}-{step} trained on these scores), "
                        f"{e}") from None
    self.passed_after = step


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


def report_entries(start: Optional[dict], history: Sequence[dict]) -> dict:
  """The report's {"teacher_parity": {"start": teacher_parity.json, "probes": [[step,
  {cell: gap}], ...]}} of a run scored through servers (the MOPD records' `parity_gaps`);
  {} for a run that was not."""
  probes = [[h["step"], h["parity_gaps"]] for h in history if "parity_gaps" in h]
  return {"teacher_parity": {"start": start, "probes": probes}} if start or probes else {}


def report_lines(rep: dict) -> list:
  """report.md's line on the parity probes: each probe's largest gap and its cell."""
  p = rep.get("teacher_parity")
  if not p:
    return []
  start = p["start"] or {}
  worst = lambda gaps: max(gaps.items(), key=lambda x: x[1])
  probes = ([("at start", worst(start["gaps"]))] if start.get("gaps") else []) + [
      (f"after step {s}", worst(gaps)) for s, gaps in p["probes"]]
  return ["", f"Teacher parity probe, largest mean |delta log p| per token (tolerance "
          f"{start.get('tolerance', '?')}): " +
          "; ".join(f"{when} {g:.3g} ({cell})" for when, (cell, g) in probes) + "."]
