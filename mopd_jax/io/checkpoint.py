"""Checkpoints: params through orbax, metadata through JSON. No pickle on any load path.

Two kinds:
  * `save_params` / `load_params`: one params pytree, the output of a finished stage
    (pi_SFT, a frozen teacher, the student).
  * `TrainLoop`: per-step checkpoints of one training loop (an orbax `CheckpointManager`
    keeping the last two complete steps, saved asynchronously): the train state (params,
    optimizer state, step) plus JSON metadata (loop step, per-step history, data-iterator
    positions, count of skipped non-finite steps). It also carries the SIGTERM protocol
    (finish the step, save, wait, raise `Preempted`) and the non-finite-step policy.

Every restore is checked against the tree the caller expects; a mismatch names every
differing path (`CheckpointMismatchError`).
"""
from __future__ import annotations

import contextlib
import copy
import os
import signal
import threading
import time
import warnings
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mopd_jax.io import storage

# What a preempted process exits with: 128 + SIGTERM, the status a shell reports for a
# process killed by SIGTERM, so schedulers read it as "preempted, run again".
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


def save_params(path: str, params) -> None:
  """Write a params pytree to `path` (a new directory) and wait until it is complete."""
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(epath.Path(path).absolute(), params, force=True)
  ckptr.wait_until_finished()


def load_params(path: str, like=None, sharding=None):
  """Restore params; `like` (a pytree of arrays or ShapeDtypeStructs) fixes the expected tree,
  shapes and dtypes, `sharding` places each leaf (shard by shard) on a mesh."""
  path = epath.Path(path).absolute()
  if not path.exists():
    raise FileNotFoundError(f"no checkpoint at {path}")
  ckptr = ocp.StandardCheckpointer()
  if like is None:
    # The saved tree, whole on this process's first device: readable on any machine, not
    # only on the topology that wrote it.
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one),
                          _saved_tree(ckptr.metadata(path)))
    return ckptr.restore(path, target)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), like)
  check_tree(target, _saved_tree(ckptr.metadata(path)), f"checkpoint {path}")
  if sharding is None and all(getattr(x, "sharding", None) is not None
                              for x in jax.tree.leaves(like)):
    sharding = jax.tree.map(lambda x: x.sharding, like)  # restore where `like` lives
  if sharding is not None:
    target = jax.tree.map(lambda t, s: jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=s),
                          target, sharding)
  return ckptr.restore(path, target)


def write_json(path: str, obj: Any) -> None:
  """Atomic JSON write: a reader never sees a half-written file. In a multi-process run only
  process 0 writes (the workdir is shared; the pipeline syncs the processes after a stage)."""
  if jax.process_index() != 0:
    return
  storage.write_json(path, obj)


def read_json(path: str, default: Optional[Any] = None) -> Any:
  return storage.read_json(path, default)


# ----------------------------------------------------------------------------- tree checks


class CheckpointMismatchError(ValueError):
  """A checkpoint's keys, shapes or dtypes differ from the tree the caller expects."""


def _key_str(key) -> str:
  for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey / FlattenedIndexKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def tree_spec(tree) -> dict:
  """{"a/b/c": (shape, dtype name)} for every array-like leaf (arrays, ShapeDtypeStructs and
  orbax's ArrayMetadata all have .shape and .dtype). Paths join dict keys, attribute names and
  sequence indices, so a TrainState and orbax's saved nested dicts spell a leaf alike."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(_key_str(k) for k in path): (tuple(x.shape), np.dtype(x.dtype).name)
          for path, x in leaves}


def check_tree(expected, found, what: str) -> None:
  """Raise CheckpointMismatchError naming every path whose key, shape or dtype differs."""
  exp, got = tree_spec(expected), tree_spec(found)
  fmt = lambda spec: f"{spec[1]}{list(spec[0])}"
  problems = []
  for path in sorted(exp.keys() | got.keys()):
    if path not in got:
      problems.append(f"{path}: missing from the checkpoint (expected {fmt(exp[path])})")
    elif path not in exp:
      problems.append(f"{path}: in the checkpoint but not expected ({fmt(got[path])})")
    elif exp[path] != got[path]:
      problems.append(f"{path}: checkpoint has {fmt(got[path])}, expected {fmt(exp[path])}")
  if problems:
    raise CheckpointMismatchError(
        f"{what} does not match the expected tree; {len(problems)} mismatched path(s):\n  " +
        "\n  ".join(problems))


def _saved_tree(metadata):
  """The array-metadata tree inside whatever orbax returns for a saved pytree item."""
  metadata = getattr(metadata, "item_metadata", metadata)
  return getattr(metadata, "tree", metadata)


# ----------------------------------------------------------------------------- preemption


class Preempted(RuntimeError):
  """SIGTERM arrived; the current step finished and its checkpoint is complete on disk."""


_PREEMPT = threading.Event()


def preemption_requested() -> bool:
  return _PREEMPT.is_set()


def request_preemption() -> None:
  """What the SIGTERM handler does; also callable directly (tests, other signal sources)."""
  _PREEMPT.set()


@contextlib.contextmanager
def sigterm_guard():
  """While active, SIGTERM only sets a flag: the running loop finishes its step, saves,
  waits for the save and raises `Preempted`. Outside the main thread (where Python cannot
  install handlers) this is a no-op and SIGTERM keeps its default action."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  _PREEMPT.clear()

  def handler(signum, frame):
    _PREEMPT.set()
    # os.write, not print: a handler may interrupt a print and buffered IO is not reentrant.
    os.write(2, b"[preemption] SIGTERM received: finishing the current step, then saving\n")

  previous = signal.signal(signal.SIGTERM, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)
    _PREEMPT.clear()


# ----------------------------------------------------------------------------- train loops


def abstract_like(state, shardings=None):
  """ShapeDtypeStructs (with shardings when given) of a pytree: a restore target."""
  if shardings is None:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      shardings)


class TrainLoop:
  """Per-step checkpoints, SIGTERM handling and the non-finite policy of one training loop.

      with TrainLoop("sft", dir, every=10, total_steps=n, data_state=lambda: ...) as loop:
        state = loop.restore(trainer.abstract_state(params_like))
        if state is None: state = trainer.init(params)
        else: reposition the data iterators from loop.data
        for step in range(loop.start_step, n):
          state, m = trainer.step(state, batch)
          loop.end_step(step, state, m, record)

  Checkpoint `k` holds the state after loop steps 0..k-1, so a restart continues at step k
  with `loop.history` (the records of steps 0..k-1) restored. Everything a step draws must
  be a pure function of (seed, step) or of the saved data positions; then the resumed run is
  bitwise equal to an uninterrupted one.
  """

  def __init__(self, name: str, directory: str, *, every: int, total_steps: int,
               skip_nonfinite: bool = False, data_state: Callable[[], Any] = dict,
               max_to_keep: int = 2):
    if not (isinstance(every, int) and every >= 1):
      raise ValueError(f"{name}: checkpoint interval must be a positive int, got {every!r}")
    self.name, self.every, self.total_steps = name, every, total_steps
    self.skip_nonfinite, self.data_state = skip_nonfinite, data_state
    self.directory = epath.Path(directory).absolute()
    # Two kept steps: if the newest turns out unreadable the one before it still restores.
    # Temporary directories of saves cut short (SIGKILL) are never listed as steps and are
    # removed when the manager opens.
    # Handlers named up front: a fresh process can then read the metadata of saved steps.
    self._mgr = ocp.CheckpointManager(
        self.directory, item_handlers={"state": ocp.StandardCheckpointHandler(),
                                       "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=True,
                                             cleanup_tmp_directories=True))
    self.history: list = []
    self.skipped = 0
    self.start_step = 0
    self.last_saved: Optional[int] = None
    self.data: Any = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
    return False

  def wait(self) -> None:
    """Block until the in-flight async save (if any) is complete on disk."""
    self._mgr.wait_until_finished()

  def close(self) -> None:
    """Wait for an in-flight async save, so no exit path leaves a half-written step."""
    self.wait()
    self._mgr.close()

  def restore(self, target):
    """The state of the newest complete, readable checkpoint, or None when there is none.

    `target`: the abstract train state (ShapeDtypeStructs with shardings); a saved tree with
    other keys, shapes or dtypes raises CheckpointMismatchError naming every such path. An
    unreadable step is deleted with a warning and the previous one is tried; if steps exist
    but none is readable, RuntimeError.
    """
    steps = sorted(self._mgr.all_steps(), reverse=True)
    failures = []
    for step in steps:
      where = f"{self.name} checkpoint {self.directory / str(step)}"
      saved, err = None, None
      try:
        saved = _saved_tree(self._mgr.item_metadata(step)["state"])
      except Exception as e:  # unreadable metadata: a corrupted step
        err = e
      if saved is None and err is None:
        err = FileNotFoundError("no readable metadata of the saved train state")
      if saved is not None:
        check_tree(target, saved, where)  # a wrong architecture is not corruption: fail
        try:
          restored = self._mgr.restore(step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
          meta = restored.meta
          if not isinstance(meta, dict) or meta.get("step") != step:
            raise ValueError(f"metadata {meta!r} does not describe step {step}")
        except Exception as e:
          err = e
        else:
          self.history, self.skipped = list(meta["history"]), int(meta["skipped"])
          self.start_step = self.last_saved = step
          self.data = meta["data"]
          print(f"[{self.name}] resuming from checkpoint step {step} in {self.directory}",
                flush=True)
          return restored.state
      failures.append(f"step {step}: {type(err).__name__}: {err}")
      aside = self._set_aside(step)
      warnings.warn(f"{where} is unreadable ({type(err).__name__}: {err}); moved to {aside} "
                    "and falling back to the previous checkpoint", RuntimeWarning, stacklevel=2)
    if failures:
      raise RuntimeError(f"{self.name}: no readable checkpoint in {self.directory}:\n  " +
                         "\n  ".join(failures) + "\nDelete the directory to restart this "
                         "loop from its beginning.")
    return None

  def _set_aside(self, step: int) -> str:
    """Move an unreadable step out of the manager's directory (kept for inspection), so the
    resumed run can save this step number again."""
    aside = epath.Path(f"{self.directory}.unreadable") / f"{step}-{time.time_ns()}"
    aside.parent.mkdir(parents=True, exist_ok=True)
    storage.rename(self.directory / str(step), aside)
    self._mgr.reload()
    return str(aside)

  def end_step(self, step: int, state, metrics: dict, *, record) -> bool:
    """Bookkeeping after loop step `step` (0-based) produced `state` and `metrics`.

    Non-finite loss or gradient norm (the Trainer did not apply the update): raise
    FloatingPointError naming the step and the metric, with nothing of this state saved; or,
    with skip_nonfinite, count the skip and go on. Then append `record` to the history and
    save on the interval, at the last step, or when SIGTERM arrived; after a SIGTERM, wait for
    the save and raise Preempted. Returns whether the update was applied.
    """
    applied = bool(metrics.get("finite", 1.0))
    if not applied:
      bad = ", ".join(f"{k}={metrics[k]}" for k in ("loss", "grad_norm")
                      if k in metrics and not np.isfinite(metrics[k])) or "finite=0"
      if not self.skip_nonfinite:
        raise FloatingPointError(
            f"{self.name} step {step}: non-finite {bad}; the update was not applied and no "
            f"checkpoint of this state was written (last complete checkpoint: step "
            f"{self.last_saved} in {self.directory}). Set skip_nonfinite=True to skip such "
            "steps instead.")
      self.skipped += 1
      warnings.warn(f"{self.name} step {step}: non-finite {bad}; step skipped "
                    f"({self.skipped} so far)", RuntimeWarning, stacklevel=2)
    self.history.append(record)
    done = step + 1
    stop = preemption_requested()
    if stop or done % self.every == 0 or done == self.total_steps:
      self.save(done, state)
    if stop:
      self.wait()
      raise Preempted(f"{self.name}: SIGTERM received; stopped after step {step} and the "
                      f"checkpoint of step {done} is complete in {self.directory}. Run the "
                      "same command again to resume from it.")
    return applied

  def save(self, done: int, state) -> None:
    """Async save of the state after `done` loop steps. The device->host copy happens before
    `save` returns, so the next (donating) train step may reuse the buffers at once."""
    if self.last_saved == done:
      return
    # A deep copy: the save is asynchronous and the JSON may be written after the loop has
    # appended the next step's record to the live history list.
    meta = copy.deepcopy({"step": done, "history": self.history, "skipped": self.skipped,
                          "data": self.data_state()})
    self._mgr.save(done, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 meta=ocp.args.JsonSave(meta)))
    self.last_saved = done
