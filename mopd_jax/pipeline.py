"""The pipeline: stages chained in order, each a module of `mopd_jax.stages`.

    data -> sft -> rl (a teacher per domain x effort) -> mopd (student) -> eval -> report

The run's domains and efforts are its config's (`mopd_jax.tasks.grid`); the toy's grid is 3 x 3.
Every stage writes its outputs under the workdir and a `DONE.json` marker last; re-running
with the same workdir skips finished stages, and `--config.stages=rl,eval` runs a subset
reusing earlier outputs. On several processes (jax.distributed) every process runs every
stage, process 0 writes the shared files, and a barrier ends each stage. Layout:

    <workdir>/data/                    TFDS array_record datasets
    <workdir>/sft/params/              pi_SFT (orbax)
    <workdir>/rl/<domain>/teacher_<e>/ the frozen teachers (orbax), one lane per domain
    <workdir>/teachers.json            the teacher manifest (with the grid it was trained on)
    <workdir>/mopd/params/             the student (orbax); mopd/history.json its curves
    <workdir>/eval.json                test-split cells of pi_SFT, every teacher, the student
    <workdir>/report.json, report.md, *.png
    <workdir>/timings.json             wall seconds per stage
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Optional, Union

import jax
from jax.experimental.compilation_cache import compilation_cache
import ml_collections

from mopd_jax import configure
from mopd_jax.config.schema import ConfigError, RunConfig
from mopd_jax.io import checkpoint, profiling, storage
from mopd_jax.runtime import distributed
from mopd_jax.stages.context import Run
from mopd_jax.stages.wiring import STAGES  # the registry, in pipeline order


def run(config: Union[RunConfig, ml_collections.ConfigDict],
        workdir: Optional[str] = None) -> dict:
  """Runs the config's stages in order; returns their wall seconds. `config`: the run's
  RunConfig (`experiments/run.py` builds it), or a ConfigDict that notebooks and tests hand
  over, built here for this process's devices.

  Errors: `ConfigError` (a ValueError) for an unknown stage, a missing workdir or any config
  value `mopd_jax.configure.build` refuses, before any stage starts."""
  if not isinstance(config, RunConfig):
    config = configure.build(config, jax.device_count())
  unknown = [s for s in config.stages if s not in STAGES]
  if unknown:
    raise ConfigError(f"unknown stage(s) {unknown}; known stages in order: {tuple(STAGES)}")
  if workdir is None and config.stages != ("smoke",):
    raise ConfigError("--workdir is required for every stage but smoke")
  ctx = Run(config, workdir or os.getcwd())
  use_compile_cache(ctx.config.compile_cache, ctx.workdir)
  timings = {}
  with checkpoint.sigterm_guard():
    for stage in STAGES:
      if stage in config.stages:
        run_stage(ctx, stage, timings)
  return timings


_CACHE_SET_HERE = [None]  # the cache directory this module put in the environment


def use_compile_cache(pattern: str, workdir: str) -> Optional[str]:
  """Turns on JAX's persistent compilation cache at `pattern` (`{workdir}` replaced), for
  this process and, through the environment, the processes it spawns (the RL lanes); every
  program is kept, however quick its compile. A JAX_COMPILATION_CACHE_DIR set outside (a
  user's, the test suite's) wins; "" leaves the cache as the environment has it. A workdir
  on object storage keeps its cache on local disk (under the temp dir, one per workdir).
  Returns the directory in use, or None."""
  outside = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if outside and outside != _CACHE_SET_HERE[0]:
    return outside
  if not pattern:
    return outside or None
  if storage.is_remote(workdir):
    local = hashlib.sha256(workdir.encode()).hexdigest()[:16]
    workdir = storage.join(tempfile.gettempdir(), "mopd_jax_workdirs", local)
  chosen = pattern.format(workdir=workdir)
  if _CACHE_SET_HERE[0] not in (None, chosen):
    compilation_cache.reset_cache()  # a second run in this process: its own directory
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_SET_HERE[0] = chosen
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  jax.config.update("jax_compilation_cache_dir", chosen)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
  return chosen


def run_stage(ctx: Run, stage: str, timings: dict) -> None:
  """One stage unless already done; a SIGTERM that arrived between stages stops here."""
  if stage != "smoke" and ctx.done(stage):
    print(f"[{stage}] already done in {ctx.workdir}; skipping")
    return
  if checkpoint.preemption_requested():
    raise checkpoint.Preempted(f"SIGTERM received before stage {stage}; finished stages are "
                               "kept. Run the same command again to continue.")
  t0, (c0, n0) = time.time(), profiling.CompileClock.read()
  STAGES[stage](ctx)
  # Multi-process: nobody starts the next stage before every process finished this one and
  # process 0's files (data, DONE.json, manifests) are on the shared workdir.
  distributed.sync(f"stage {stage} done")
  timings[stage] = time.time() - t0
  c1, n1 = profiling.CompileClock.read()
  print(f"[{stage}] finished in {timings[stage]:.1f}s ({c1 - c0:.1f}s compiling "
        f"{n1 - n0} programs in this process)")
  if stage not in ("smoke", "report"):
    all_t = checkpoint.read_json(ctx.path("timings.json"), default={"_": 0})
    all_t[stage] = timings[stage]
    all_t.setdefault("compile", {})[stage] = {"seconds": c1 - c0, "programs": n1 - n0}
    checkpoint.write_json(ctx.path("timings.json"), all_t)
