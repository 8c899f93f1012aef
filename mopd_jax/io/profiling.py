"""Profile a step range of one training loop with the JAX profiler: one config switch.

    c.profile.stage = "sft"    # "" = off; see `matches` for the names
    c.profile.start_step = 2   # first traced step: earlier steps compile and warm up
    c.profile.num_steps = 3    # traced steps

Steps [start_step, start_step + num_steps) of the first training loop whose progress bar
matches `stage` are traced into `<workdir>/profile/<bar name>/` (open it with TensorBoard's
profile plugin, XProf or Perfetto: `plugins/profile/<run>/*.trace.json.gz`). Steps are
counted by the loop's progress bar (`stages.context.Progress`, which asks the run's `Switch`
for a profiler), so every stage's loop gets the switch without code of its own, and a
resumed loop counts from the step it resumed at.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax

from mopd_jax.io import storage


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
  stage: str
  start_step: int
  num_steps: int
  root: str  # traces go to <root>/<bar name>


def spec_from_config(profile_cfg, workdir: str) -> Optional[ProfileSpec]:
  """The switch as a spec (None when off); raises ValueError on a bad value."""
  if profile_cfg is None or not profile_cfg.stage:
    return None
  stage = str(profile_cfg.stage)
  start, num = profile_cfg.start_step, profile_cfg.num_steps
  if stage.split(" ", 1)[0] not in ("sft", "rl", "mopd"):
    raise ValueError(f"profile.stage={stage!r}; expected '' (off), 'sft', 'rl', 'mopd' or a "
                     "progress-bar name such as 'rl gen/high' or 'mopd init: teacher SFT'")
  for name, v, lo in (("profile.start_step", start, 0), ("profile.num_steps", num, 1)):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
      raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
  return ProfileSpec(stage, start, num, storage.join(workdir, "profile") if workdir else
                     "profile")


def matches(stage: str, bar_name: str) -> bool:
  """`stage` names a bar exactly ("sft", "mopd", "rl gen/high") or is a prefix of RL bars
  ("rl", "rl gen"). Sub-phase bars ("mopd init: teacher SFT") match only by full name, so
  "mopd" means the distillation loop itself."""
  if bar_name == stage:
    return True
  if ":" in bar_name:
    return False
  return bar_name.startswith(stage + " ") or bar_name.startswith(stage + "/")


class StepProfiler:
  """Starts the trace before step `start` and stops it after step `start + num - 1`."""

  def __init__(self, logdir: str, start: int, num: int, *, initial: int = 0):
    self.logdir, self.start, self.stop_at = logdir, start, start + num
    self.completed = initial  # steps finished so far = index of the next step
    self.running = False
    self._maybe_start()

  def _maybe_start(self):
    if not self.running and self.start <= self.completed < self.stop_at:
      storage.makedirs(self.logdir)
      jax.profiler.start_trace(self.logdir)  # jax's own writer (local, or gs:// via TSL)
      self.running = True

  def after_step(self):
    """Call once a step's results are on the host (its device work is finished)."""
    self.completed += 1
    if self.running and self.completed >= self.stop_at:
      self.close()
    else:
      self._maybe_start()

  def close(self):
    if self.running:
      jax.profiler.stop_trace()
      self.running = False
      self.stop_at = -1  # never again in this loop


class Switch:
  """The profile switch of one run: hands a `StepProfiler` to the first loop it names, and
  to no other (one traced range per run: a second trace would bury the first)."""

  def __init__(self, profile_cfg=None, workdir: str = ""):
    self.spec = spec_from_config(profile_cfg, workdir)  # raises on a bad switch
    self.used = False

  def for_loop(self, bar_name: str, initial: int = 0) -> Optional[StepProfiler]:
    """A profiler for the loop behind progress bar `bar_name`, or None if the switch is off,
    names another loop, or has already traced one."""
    if self.spec is None or self.used or not matches(self.spec.stage, bar_name):
      return None
    self.used = True
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", bar_name).strip("_")
    return StepProfiler(storage.join(self.spec.root, safe), self.spec.start_step,
                        self.spec.num_steps, initial=initial)


# JAX's own duration events of one compilation: tracing to a jaxpr, lowering to MLIR, and
# XLA's backend compile (`jax.monitoring`).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileClock:
  """The seconds this process has spent compiling (the sum of `COMPILE_EVENTS`) and how many
  programs XLA compiled. One listener per process, registered on first use; read it before
  and after a stage to split the stage's wall time into compilation and the rest. A program
  loaded from the persistent compilation cache counts its tracing and lowering only, and is
  not counted as compiled."""
  _seconds = 0.0
  _programs = 0
  _registered = False

  @classmethod
  def _listen(cls, event: str, duration: float, **_) -> None:
    if event in COMPILE_EVENTS:
      cls._seconds += duration
      cls._programs += event == COMPILE_EVENTS[-1]

  @classmethod
  def read(cls) -> tuple:
    """(seconds, programs) so far in this process."""
    if not cls._registered:
      jax.monitoring.register_event_duration_secs_listener(cls._listen)
      cls._registered = True
    return cls._seconds, cls._programs


def compile_line(compile_seconds: dict) -> str:
  """report.md's sentence of each process's compile seconds ({stage or lane: {seconds,
  programs[, wall]}}), or "" when nothing compiled."""
  comp = {k: v for k, v in compile_seconds.items() if v["programs"]}
  if not comp:
    return ""
  return ("Of which compiling (tracing, lowering and XLA's compile; the programs XLA "
          "compiled, not counting those loaded from the run's cache): " + ", ".join(
              f"{k} {v['seconds']:.0f} s ({v['programs']} programs" +
              (f", of its {v['wall']:.0f} s)" if "wall" in v else ")")
              for k, v in comp.items()) + ".")
