"""One interface over the places teachers score from: the bank in this process on the
student's devices (`colocated`) or on a slice of their own (`disaggregated`), both
`placement.TeacherScorer`, and teacher servers (`endpoint`, `client.EndpointScorer`: this
package's server or vLLM).

A scoring source is called on a stratified batch, `source(tokens [K, b, T], mask [K, b, T])`
-> log-probs [K, b, T] (each position's log-prob of its token given the tokens before it, 0 at
t = 0), and answers two questions the work around it needs:

- `info()`: what it is (`SourceInfo`): its kind, the cells it scores in the bank's order,
  its vocabulary size and tokenizer fingerprint (the meaning of the ids it reads), the
  longest sequence it scores and the most top-k log-probs it returns per position;
- `score_probe(probe)`: the log-probs of a fixed set of token rows per cell (`Probe`), so
  that two sources can be compared on the same probe set (a parity check between an engine
  and the in-process bank).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

import numpy as np

KINDS = ("colocated", "disaggregated", "endpoint")


@dataclasses.dataclass(frozen=True)
class SourceInfo:
  """What a scoring source is. `max_sequence`: the longest prompt + response it scores, in
  tokens; `max_logprobs`: the most top-k log-probs it returns per position (an in-process
  bank: its whole vocabulary)."""
  kind: str
  cells: tuple
  vocab_size: int
  tokenizer_hash: str
  max_sequence: int
  max_logprobs: int

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"SourceInfo.kind must be one of {KINDS}, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class Probe:
  """A probe set: token rows to score per cell, {cell: ((id, ...), ...)}."""
  rows: Mapping[str, tuple]

  @classmethod
  def of(cls, rows: Mapping[str, Sequence[Sequence[int]]]) -> "Probe":
    out = {c: tuple(tuple(int(i) for i in r) for r in rs) for c, rs in rows.items()}
    if not out or any(not rs or any(len(r) < 2 for r in rs) for rs in out.values()):
      raise ValueError("a probe needs at least one row of two or more tokens per cell")
    return cls(out)


class ScoringSource(Protocol):
  """What every teacher source provides (see the module docstring)."""

  def __call__(self, tokens_KxbxT, input_mask_KxbxT): ...

  def info(self) -> SourceInfo: ...

  def score_probe(self, probe: Probe) -> dict: ...


def check_cells(probe: Probe, cells: Sequence[str]) -> None:
  """ValueError for a probe cell that a source scoring `cells` does not score."""
  unknown = sorted(set(probe.rows) - set(cells))
  if unknown:
    raise ValueError(f"the probe names cells {unknown} that the source does not score "
                     f"(it scores {list(cells)})")


def stratified_probe(probe: Probe, cells: Sequence[str], *, pad_id: int = 0,
                     row_multiple: int = 1) -> tuple:
  """(tokens [K, b, T], mask [K, b, T]) of `probe` laid out by `cells` (the bank's order):
  each cell's rows right-padded, b rounded up to `row_multiple` (a mesh's batch axes), the
  cells the probe leaves out empty (`check_cells` first)."""
  check_cells(probe, cells)
  b = max(len(rs) for rs in probe.rows.values())
  b = -(-b // row_multiple) * row_multiple
  t = max(len(r) for rs in probe.rows.values() for r in rs)
  tokens = np.full((len(cells), b, t), pad_id, np.int32)
  mask = np.zeros((len(cells), b, t), bool)
  for k, cell in enumerate(cells):
    for i, row in enumerate(probe.rows.get(cell, ())):
      tokens[k, i, :len(row)], mask[k, i, :len(row)] = row, True
  return tokens, mask


def unstack_probe(logprobs_KxbxT, probe: Probe, cells: Sequence[str]) -> dict:
  """{cell: [log-probs of each of its probe rows, float32 [len(row)]]} from a stratified
  result laid out by `stratified_probe`."""
  lp = np.asarray(logprobs_KxbxT, np.float32)
  return {cell: [lp[cells.index(cell), i, :len(row)] for i, row in enumerate(rows)]
          for cell, rows in probe.rows.items()}
