"""Host allocator benchmark: `python -m benchmarks.allocator [--steps N] [--rounds R] [--json]`.

The toy's SFT update (its model: 4 layers, d_model 128, int4 QAT; 24 rows of 128 tokens) run
N times in a fresh process under the system malloc and under tcmalloc (`LD_PRELOAD`), the
two alternated R times, all in one invocation on this machine. Reports each mode's best wall
seconds per update (compilation excluded), its minor page faults and kernel CPU seconds per
update, the speedup, and whether the two modes' final parameters are bitwise equal (they
must be: an allocator decides where buffers live, not what is computed). Needs a tcmalloc
the dynamic loader finds (`mopd_jax/runtime/allocator.py`); without one it says so and exits 1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time


def worker(steps: int) -> dict:
  """`steps` SFT updates after one compiling update; wall, faults and kernel time of them."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from mopd_jax import models  # pylint: disable=g-import-not-at-top
  from mopd_jax.runtime import allocator, sharding
  from mopd_jax.training import step as train
  cfg = models.get_preset("toy", num_layers=4, d_model=128, quant="int4")
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  trainer = train.Trainer(cfg, train.LossConfig(kind="sft"),
                          train.OptimConfig(lr=1e-3, warmup_steps=0), mesh=mesh)
  state = trainer.init(models.init_params(cfg, jax.random.PRNGKey(0)))
  rng = np.random.RandomState(0)
  rows, width = 24, 128
  lengths = rng.randint(width // 2, width + 1, size=rows)
  mask = np.arange(width)[None, :] < lengths[:, None]
  batch = train.TrainBatch(
      tokens=jax.device_put(np.where(mask, rng.randint(1, cfg.vocab_size, (rows, width)),
                                     0).astype(np.int32)),
      input_mask=jax.device_put(mask), loss_mask=jax.device_put(mask & (np.arange(width) >= 16)))
  state, m = trainer.step(state, batch)  # compiles
  jax.block_until_ready(m)
  before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  for _ in range(steps):
    state, m = trainer.step(state, batch)
    jax.block_until_ready(m)
  wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(jax.device_get(state.params)):
    digest.update(np.ascontiguousarray(leaf).tobytes())
  return {"allocator": allocator.describe(), "seconds_per_step": wall / steps,
          "minor_faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
          "kernel_seconds_per_step": (after.ru_stime - before.ru_stime) / steps,
          "params_sha256": digest.hexdigest()}


def run_mode(mode: str, steps: int, library: str) -> dict:
  env = dict(os.environ)
  env.pop("LD_PRELOAD", None)
  env["MOPD_ALLOCATOR"] = "system"  # the worker is started here, with the mode's preload
  if mode == "tcmalloc":
    env["LD_PRELOAD"] = library
  out = subprocess.run([sys.executable, "-m", "benchmarks.allocator", "--worker",
                        "--steps", str(steps)], env=env, check=True, capture_output=True,
                       text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--json", action="store_true")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    print(json.dumps(worker(args.steps)))
    return 0
  from mopd_jax.runtime import allocator  # pylint: disable=g-import-not-at-top
  library = allocator.tcmalloc_library()
  if library is None:
    print(f"no tcmalloc found: {allocator.HINT}", file=sys.stderr)
    return 1
  runs = {"system": [], "tcmalloc": []}
  for _ in range(args.rounds):
    for mode in runs:
      runs[mode].append(run_mode(mode, args.steps, library))
  best = {m: min(runs[m], key=lambda r: r["seconds_per_step"]) for m in runs}
  result = {
      "steps": args.steps, "rounds": args.rounds, "library": library,
      **{f"{m}_{k}": best[m][k] for m in runs
         for k in ("seconds_per_step", "minor_faults_per_step", "kernel_seconds_per_step")},
      "speedup": best["system"]["seconds_per_step"] / best["tcmalloc"]["seconds_per_step"],
      "tcmalloc_loaded": all(r["allocator"] == "host allocator: tcmalloc"
                             for r in runs["tcmalloc"]),
      "bitwise_equal": len({r["params_sha256"] for rs in runs.values() for r in rs}) == 1,
  }
  if args.json:
    print(json.dumps(result, indent=2))
  else:
    for m in runs:
      print(f"{m:9s} {best[m]['seconds_per_step'] * 1e3:7.1f} ms/update  "
            f"{best[m]['minor_faults_per_step']:9.0f} page faults/update  "
            f"{best[m]['kernel_seconds_per_step'] * 1e3:6.1f} ms kernel/update")
    print(f"speedup x{result['speedup']:.2f}; parameters bitwise equal: "
          f"{result['bitwise_equal']}")
  return 0 if result["bitwise_equal"] and result["tcmalloc_loaded"] else 1


if __name__ == "__main__":
  sys.exit(main())
