"""The run report's PNG plots (`report.write` calls `plots`): accuracy and length per cell,
the MOPD KL curves, length against effort."""
from __future__ import annotations

import io
from typing import Sequence

import numpy as np

from mopd_jax.io import storage
from mopd_jax.tasks.grid import Grid


def plots(rep: dict, outdir: str, *, policies: Sequence[str]) -> list:
  """cells.png (accuracy and length per cell and policy), kl.png (the MOPD KL and reward
  curves) and length.png (length against effort) of a report `rep`, written to `outdir`;
  returns their paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  by = {(c["policy"], c["domain"], c["effort"]): c for c in rep["cells"]}
  grid = Grid.from_json(rep["grid"])
  efforts, n = list(grid.by_budget), len(grid.domains)
  written = []
  fig, axes = plt.subplots(2, n, figsize=(1 + 4 * n, 7), squeeze=False)
  for j, d in enumerate(grid.domains):
    for i, key in enumerate(("accuracy", "mean_length")):
      ax = axes[i, j]
      x = np.arange(len(efforts))
      for k, p in enumerate(policies):
        vals = [by.get((p, d, e), {}).get(key, np.nan) for e in efforts]
        ax.bar(x + (k - (len(policies) - 1) / 2) * 0.27, vals, 0.27, label=p)
      ax.set_xticks(x, efforts)
      ax.set_title(f"{d}: {key}")
      if i == 0 and j == 0:
        ax.legend()
  fig.tight_layout()
  written.append(_save(fig, outdir, "cells.png"))

  if rep["kl"]["curve"]:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    # The exact KL where measured (smoothed), else the sampled-token estimate.
    exact = bool(rep.get("kl_exact_curve"))
    c = np.asarray(rep["kl_exact_curve"] if exact else rep["kl"]["curve"])
    a1.plot(c[:, 0], _smooth(c[:, 1]), label="all cells", color="k")
    per_cell = rep["kl_exact_per_cell"] if exact else rep["kl_per_cell"]
    for name, cc in per_cell.items():
      cc = np.asarray(cc)
      if len(cc):
        a1.plot(cc[:, 0], _smooth(cc[:, 1]), alpha=0.5, lw=0.8, label=name)
    a1.set_yscale("symlog", linthresh=1e-3)
    a1.legend(fontsize=6, ncol=2)
    a1.set_title("per-token KL student vs routed teacher" +
                 (" (exact, smoothed)" if exact else " (sampled-token estimate, smoothed)"))
    a1.set_xlabel("MOPD step")
    r = np.asarray(rep["reward_curve"])
    a2.plot(r[:, 0], r[:, 1])
    a2.set_title("mean per-token reward r_t")
    a2.set_xlabel("MOPD step")
    fig.tight_layout()
    written.append(_save(fig, outdir, "kl.png"))

  fig, axes = plt.subplots(1, n, figsize=(4 * n, 3.5), squeeze=False)
  for j, d in enumerate(grid.domains):
    for p in policies:
      vals = [by.get((p, d, e), {}).get("mean_length", np.nan) for e in efforts]
      axes[0, j].plot(efforts, vals, marker="o", label=p)
    axes[0, j].set_title(f"{d}: length vs effort")
  axes[0, 0].legend()
  fig.tight_layout()
  written.append(_save(fig, outdir, "length.png"))
  return written


def _smooth(y, window: int = 5):
  """A centred moving average (the ends average what they have)."""
  y = np.asarray(y, np.float64)
  if len(y) < 3:
    return y
  k = np.ones(min(window, len(y)))
  return np.convolve(y, k, "same") / np.convolve(np.ones_like(y), k, "same")


def _save(fig, outdir: str, name: str) -> str:
  """The figure rendered to PNG bytes and written through mopd_jax.io.storage."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=90)
  plt.close(fig)
  path = storage.join(outdir, name)
  storage.write_bytes(path, buf.getvalue())
  return path
