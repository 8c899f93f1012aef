"""Multi-host runs on JAX's multi-controller runtime (`jax.distributed`).

Every process runs the same program on its own devices; a jitted step over a global mesh is
one SPMD program across all of them. What a process must do differently from a single-host
run, and where it happens:

  * start the runtime before anything touches a backend: `initialize(config.distributed)`
    (config fields, else the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
    environment variables, else JAX's own detection on TPU pods and SLURM clusters);
  * read only its own rows of each global batch (`process_rows`) and assemble the global
    array from them (`global_batch`, `jax.make_array_from_process_local_data`): no host
    ever holds the whole batch, and no bytes cross hosts to build it;
  * fetch sharded results with `gather` (every process gets the full value);
  * checkpoints: every process calls `checkpoint.save_params` / `load_params` (orbax
    writes each process's shards and synchronises the processes);
  * logs, reports, JSON and plots: process 0 only (`is_main`; `metrics.MetricsLogger`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from mopd_jax.runtime import sharding

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}


def settings(block: Optional[Mapping] = None,
             environ: Optional[Mapping] = None) -> Optional[dict]:
  """The jax.distributed.initialize arguments a config block (else the environment) asks
  for; None means stay single-process, {} means let JAX detect everything (TPU pods, SLURM).
  Raises ValueError on inconsistent settings. `block`: a mapping or the typed `distributed`
  block of a RunConfig."""
  block = dataclasses.asdict(block) if dataclasses.is_dataclass(block) else dict(block or {})
  environ = os.environ if environ is None else environ
  addr = block.get("coordinator_address") or environ.get(ENV["coordinator_address"], "")
  n = int(block.get("num_processes") or environ.get(ENV["num_processes"]) or 0)
  pid = block.get("process_id", -1)
  pid = int(environ.get(ENV["process_id"], -1) if pid is None or pid < 0 else pid)
  if not addr and not block.get("initialize"):
    if n > 1:
      raise ValueError(f"distributed.num_processes={n} but no coordinator address (set "
                       f"distributed.coordinator_address or {ENV['coordinator_address']})")
    return None
  out = {}
  if addr:
    out["coordinator_address"] = addr
  if n:
    out["num_processes"] = n
  if pid >= 0:
    if n and pid >= n:
      raise ValueError(f"distributed.process_id={pid} is not below num_processes={n}")
    out["process_id"] = pid
  return out


def initialize(block: Optional[Mapping] = None, cpu_collectives: str = "gloo") -> bool:
  """Start jax.distributed if the config or environment asks for it; True when it did.

  Call before any other JAX call that touches a device. `cpu_collectives`: the CPU backend
  needs an explicit cross-process collectives implementation (gloo) for simulated runs;
  accelerators use their own (ICI / NCCL) and ignore it.
  """
  kwargs = settings(block)
  if kwargs is None:
    return False
  if cpu_collectives:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(**kwargs)
  return True


def is_main() -> bool:
  """Process 0 writes logs, reports and other host-side files."""
  return jax.process_index() == 0


def process_rows(mesh: Mesh, global_rows: int) -> slice:
  """The rows of a [global_rows, ...] batch this process's devices hold: what its data
  loader must read. Contiguous because `make_mesh` lays devices out process by process."""
  sharding.check_batch_divisible(global_rows, mesh)
  sh = sharding.batch_sharding(mesh, 1)
  spans = {(s[0].start or 0, global_rows if s[0].stop is None else s[0].stop)
           for s in sh.addressable_devices_indices_map((global_rows,)).values()}
  start, stop = min(a for a, _ in spans), max(b for _, b in spans)
  covered = sum(b - a for a, b in spans)
  if covered != stop - start:
    raise ValueError(f"process {jax.process_index()} holds non-contiguous rows {sorted(spans)} "
                     f"of the batch on mesh {dict(mesh.shape)}; order the mesh devices by "
                     "process")
  return slice(start, stop)


def global_batch(mesh: Mesh, local_tree, global_rows: int, *, leading: tuple = ()):
  """Global arrays, split over the batch axes, from this process's rows (numpy or arrays
  of [local_rows, ...]; with `leading=("teacher",)` or `(None,)`, [K, local_rows, ...])."""
  def one(x):
    x = np.asarray(x)
    lead = len(leading)
    shape = x.shape[:lead] + (global_rows,) + x.shape[lead + 1:]
    sh = sharding.batch_sharding(mesh, x.ndim, leading=leading)
    return jax.make_array_from_process_local_data(sh, x, shape)
  return jax.tree.map(one, local_tree)


def to_global(tree, shardings):
  """Global arrays from host values that every process holds in full (a batch every process
  built from the same data and seed): each process materialises only the shards its own
  devices hold, so nothing crosses hosts. `shardings`: one sharding for every leaf, or a
  pytree of them. Arrays that already span processes pass through unchanged."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)

  def one(x, s):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])
  return jax.tree.map(one, tree, shardings)


def mesh_of(tree) -> Mesh:
  """The mesh a pytree of arrays is laid out on (its first `NamedSharding`)."""
  for x in jax.tree.leaves(tree):
    sh = getattr(x, "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
      return sh.mesh
  raise ValueError("these arrays are not laid out on a mesh (no NamedSharding): in a "
                   "multi-process run params must be placed with sharding.param_shardings")


def gather(tree):
  """The full value of every (possibly cross-process sharded) array, on every process. A
  numpy array is a host value every process already holds in full (e.g. the scores a
  teacher server's answers, relayed from process 0): it passes unchanged."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return jax.tree.map(lambda x: x if isinstance(x, np.ndarray) else
                      multihost_utils.process_allgather(x, tiled=True), tree)


def allgather_texts(local: list) -> list:
  """Every process's list of strings (the same count on each), concatenated in process
  order, on every process: e.g. the examples each process read from its own shard."""
  if jax.process_count() == 1:
    return list(local)
  data = [t.encode("utf-8") for t in local]
  lens = np.asarray([len(b) for b in data], np.int32)
  width = int(np.max(multihost_utils.process_allgather(
      np.asarray([lens.max(initial=0)], np.int32))))
  buf = np.zeros((len(data), max(width, 1)), np.uint8)
  for i, b in enumerate(data):
    buf[i, :len(b)] = np.frombuffer(b, np.uint8)
  all_lens = np.asarray(multihost_utils.process_allgather(lens)).reshape(-1)
  all_buf = np.asarray(multihost_utils.process_allgather(buf)).reshape(-1, buf.shape[1])
  return [bytes(row[:n]).decode("utf-8") for row, n in zip(all_buf, all_lens)]


def broadcast_text(text: str) -> str:
  """Process 0's string, on every process (the others' `text` is not read)."""
  if jax.process_count() == 1:
    return text
  data = np.frombuffer(text.encode("utf-8"), np.uint8) if is_main() else np.zeros(0, np.uint8)
  n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([data.size], np.int32)))[0])
  buf = np.zeros(max(n, 1), np.uint8)
  buf[:data.size] = data
  got = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  return bytes(got[:n]).decode("utf-8")


def sync(name: str) -> None:
  """Barrier: every process reaches `name` before any goes on (e.g. before reading files
  that process 0 wrote)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
