"""Length groups of a training batch: its rows sorted by length into equal groups, each
cut to the columns its longest row needs, so that a batch mixing 3-token answers with
150-token traces is trained on far fewer padded tokens (`OptimConfig.length_groups`; the
update over the groups is `train.Trainer.grouped_step`)."""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np


def row_lengths(input_mask) -> np.ndarray:
  """[B] the columns each row needs: one past its last real token (0 for an empty row)."""
  m = np.asarray(input_mask).astype(bool)
  t = m.shape[1]
  return np.where(m.any(1), t - np.argmax(m[:, ::-1], axis=1), 0)


def split(batch, groups: int, *, unit: int = 1, multiple: int = 32,
                  row_divisor: int = 1) -> Optional[list]:
  """The rows of `batch` as `groups` TrainBatches of equal row counts, shortest rows first,
  each cut to the columns its longest row needs rounded up to a multiple of `multiple`
  (never wider than the batch); or None when that saves no column, or the rows do not split
  into whole `unit`s (the group losses' K rows of a prompt, kept together and ordered by
  their longest) with a multiple of `row_divisor` rows per group (the batch's devices).

  The rows a group holds and their order within it do not matter to the losses (they are
  means over rows or tokens, weighted back to the whole batch by `slice_weights`); the
  columns cut off hold only padding."""
  b, t = batch.tokens.shape
  if groups <= 1 or b % (unit * groups) or (b // groups) % row_divisor:
    return None
  per_unit = row_lengths(batch.input_mask).reshape(b // unit, unit).max(1)
  order = np.argsort(per_unit, kind="stable").reshape(groups, -1)
  widths = [min(t, max(1, -(-int(per_unit[u].max()) // multiple)) * multiple) for u in order]
  if all(w == t for w in widths):
    return None
  out = []
  for units, w in zip(order, widths):
    rows = (units[:, None] * unit + np.arange(unit)).ravel()
    out.append(jax.tree.map(lambda x, w=w, rows=rows: (x[rows, :w] if x.ndim >= 2 and
                                                       x.shape[1] == t else x[rows]), batch))
  return out
