"""The parity probe's gaps on a finished run's teachers: how far from the in-process teachers
(at `mopd.teacher_temperature`) each kind of source scores the probe set, which is what
`teacher.parity_tolerance` is chosen from.

    python -m experiments.teacher_parity --config configs/toy.py --workdir DIR [--rows 4]

Rows of the printed table, each cell's mean |delta log p| per token (max and mean over the
cells): a teacher server in this process's loopback (`mopd_jax.teachers.server`, batch-
invariant float32 scoring, the same params and temperature: float rounding alone); the same
teachers computing in bfloat16 (the rounding gap of a bf16 engine); the same teachers at
temperature 1 (a vLLM-style engine that ignores the request's temperature); the
teachers with their cells rotated (a server serving another cell's checkpoint under a name);
and a uniform teacher (all-zero params).
"""
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_ROWS = flags.DEFINE_integer("rows", 4, "Validation examples per cell in the probe set.")


def measure(ctx, *, rows: int) -> dict:
  """{source name: {cell: gap}} against the in-process teachers at the scoring temperature."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from mopd_jax.io import tokenizer  # pylint: disable=g-import-not-at-top
  from mopd_jax.stages import wiring  # pylint: disable=g-import-not-at-top
  from mopd_jax.teachers import client, parity, placement, server  # pylint: disable=g-import-not-at-top
  temperature = ctx.config.mopd.teacher_temperature
  if ctx.teachers.mixed:
    raise SystemExit("config error: teachers of several families: the parity measure "
                     "compares one bank with its server and variants; run it per family")
  bank = ctx.teachers.load_bank()
  scoring = wiring.scoring_bank(ctx, bank)
  fp = tokenizer.fingerprint(ctx.teachers.tok)

  def local(b):
    return placement.TeacherScorer(b, ctx.mesh, ctx.teacher_mesh, tokenizer_hash=fp)

  probe = wiring.parity_probe_set(ctx, rows=rows, max_len=scoring.model_cfg.max_seq_len)
  reference = local(scoring)
  out = {}
  srv = server.TeacherServer(bank, ctx.teachers.tok, temperature=temperature)
  srv.start()
  remote = client.EndpointScorer(ctx.grid.names, {n: srv.url for n in ctx.grid.names})
  try:
    out["server, same params and temperature"] = parity.gaps(reference, remote, probe)
  finally:
    remote.close()
    srv.stop()
  low = dataclasses.replace(scoring.model_cfg, param_dtype="bfloat16", dtype="bfloat16")
  bf16 = scoring.replace(model_cfg=low, params=jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                            scoring.params))
  out["the same teachers in bfloat16 (params and compute)"] = parity.gaps(reference,
                                                                          local(bf16), probe)
  out["the same teachers at temperature 1"] = parity.gaps(reference, local(bank), probe)
  rotated = bank.replace(params=jax.tree.map(lambda x: np.roll(np.asarray(x), 1, axis=0),
                                             scoring.params))
  out["each cell scored by the next cell's teacher"] = parity.gaps(reference, local(rotated),
                                                                   probe)
  uniform = bank.replace(params=jax.tree.map(np.zeros_like, jax.device_get(bank.params)))
  out["a uniform teacher (zero params)"] = parity.gaps(reference, local(uniform), probe)
  return out


def main(argv):
  ctx = common.run_of(argv, config=_CONFIG.value, workdir=_WORKDIR.value)
  out = measure(ctx, rows=_ROWS.value)
  print(f"| source (against the in-process teachers at T="
        f"{ctx.config.mopd.teacher_temperature}) | max over cells | mean over cells | "
        "min over cells |")
  print("|---|---|---|---|")
  for name, gaps in out.items():
    v = np.asarray(list(gaps.values()))
    print(f"| {name} | {v.max():.3g} | {v.mean():.3g} | {v.min():.3g} |")


if __name__ == "__main__":
  app.run(main)
