"""What every stage's training loops share: the workdir's files, the checkpointed loop
skeleton, the data streams' positions, progress bars and metric logs.

    files = Workdir("/tmp/run")                      # paths, DONE markers
    loops = Loops(files, every=10, skip_nonfinite=0, params_like=..., switch=...)
    with loops.training("sft", files.path("sft", "ckpt"), trainer, total_steps=100,
                        init=...) as (loop, state, bar):
      ...

`training(...)` is the skeleton of every training loop (SFT, each RL phase, the teacher-SFT
initialisation, MOPD): per-step checkpoints under a directory, restore or initialise the
state, reposition the data iterators, and a progress bar. The pipeline builds one `Loops`
per run and hands it to the stages that train.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import jax

from mopd_jax.io import checkpoint, metrics, profiling, storage
from mopd_jax.training import step as train

# mopd/init_params: the student after the teacher-SFT initialisation, before any MOPD step
# (written by the mopd stage, read by the eval's held-out KL).
INIT_PARAMS = "init_params"

@dataclasses.dataclass(frozen=True)
class Workdir:
  """The run's directory (local or object storage: mopd_jax/io/storage.py) and its stages'
  `DONE.json` markers."""
  root: str

  def path(self, *parts) -> str:
    return storage.join(self.root, *parts)

  def done(self, stage: str) -> bool:
    return storage.exists(self.path(stage, "DONE.json"))

  def mark_done(self, stage: str, info: dict) -> None:
    checkpoint.write_json(self.path(stage, "DONE.json"), info)


@dataclasses.dataclass(frozen=True)
class Streams:
  """Data iterators by name as a loop's checkpoint keeps them: `state()` their positions,
  `restore(positions)` puts them back."""
  iterators: dict

  def state(self) -> dict:
    return {k: it.state() for k, it in self.iterators.items()}

  def restore(self, data: dict) -> None:
    for k, pos in data.items():
      self.iterators[k].restore(pos)


@dataclasses.dataclass(frozen=True)
class Loops:
  """The run's loop settings: checkpoints every `every` steps, the non-finite policy
  (`skip_nonfinite`), the restore target of the params (`params_like`, a function: shapes,
  dtypes and shardings on the student's mesh), the profile `switch`; metric logs under
  `files`' tb/."""
  files: Workdir
  every: int
  skip_nonfinite: int
  params_like: Callable[[], Any]
  switch: Optional[profiling.Switch] = None

  def logger(self, stage: str) -> metrics.MetricsLogger:
    return metrics.MetricsLogger(self.files.path("tb", stage))

  @contextlib.contextmanager
  def training(self, name: str, directory: str, trainer: train.Trainer, *, total_steps: int,
               init: Callable[[], train.TrainState], data_state: Callable[[], dict] = dict,
               restore_data: Callable[[dict], None] = lambda data: None):
    """The skeleton of every training loop: yields (loop, state, bar).

    Per-step checkpoints of the loop go under `directory` (checkpoint.TrainLoop: SIGTERM,
    non-finite policy, restore validation). The state is the loop's last checkpoint restored
    onto this run's mesh, with the data streams repositioned by `restore_data(loop.data)`,
    or `init()` when there is none. The caller runs steps from `loop.start_step`, calling
    `loop.end_step` and `bar.update` after each."""
    loop = checkpoint.TrainLoop(name, directory, every=self.every, total_steps=total_steps,
                                data_state=data_state, skip_nonfinite=self.skip_nonfinite)
    with loop:
      state = loop.restore(trainer.abstract_state(self.params_like()))
      if state is None:
        state = init()
      else:  # continue the data streams exactly where the checkpoint left them
        restore_data(loop.data)
      bar = Progress(name, total_steps, initial=loop.start_step, switch=self.switch)
      try:
        yield loop, state, bar
      finally:
        bar.close()


class Progress:
  """A progress line per loop with rate and ETA (tqdm); where the profile switch traces."""

  def __init__(self, name: str, total: int, initial: int = 0,
               *, switch: Optional[profiling.Switch] = None):
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    # Every process runs the same loop; only process 0 draws the bar (like MetricsLogger).
    self.bar = tqdm(total=total, initial=initial, desc=name, unit="step", dynamic_ncols=True,
                    mininterval=1.0, disable=jax.process_index() != 0)
    # The bar counts the loop's steps, so it is also where `config.profile` traces a range.
    self.profiler = None if switch is None else switch.for_loop(name, initial)

  def update(self, metrics: dict, keys=("loss", "reward", "length", "accuracy")):
    self.bar.set_postfix({k: f"{metrics[k]:.3f}" for k in keys if k in metrics}, refresh=False)
    self.bar.update(1)
    if self.profiler is not None:
      self.profiler.after_step()

  def close(self):
    self.bar.close()
    if self.profiler is not None:
      self.profiler.close()
