"""Where the teachers live: on the student's devices or on their own.

Two placements, chosen by `config.placement.teachers`:

  * `colocated`: one mesh over every device. The stacked bank is sharded like the student
    (fsdp / tensor) and, when the `teacher` mesh axis is > 1 and divides K, its leading axis
    is split over `teacher` so each teacher lives on its own slice of devices. Every device
    holds 1/N of the bank, all the time, next to the student's params, optimizer state and
    activations; scoring and training take turns on the same chips.
  * `disaggregated`: the devices are split into a student sub-mesh (`config.mesh`) and a
    teacher sub-mesh (`config.placement.teacher_mesh`, the last devices). The bank lives only
    on the teacher devices; trajectories go there and log-probs come back with
    `jax.device_put` ([K, b, T] int32 + bool in, float32 out: a few MB per step). The student
    devices hold no teacher bytes, and teacher scoring of one batch can run while the student
    samples the next (asynchronous scoring).

`TeacherScorer` hides the difference: call it with a stratified batch on the student mesh,
get [K, b, T] log-probs back on the student mesh.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from mopd_jax.config import choices
from mopd_jax.runtime import distributed, sharding
from mopd_jax.teachers import bank as teachers, source

PLACEMENTS = choices.PLACEMENTS


def make_meshes(student_shape: Mapping[str, int], teacher_shape: Optional[Mapping[str, int]],
                kind: str, *, devices: Optional[Sequence] = None) -> tuple:
  """(student mesh, teacher mesh). Co-located: the same mesh twice (`teacher_shape` is
  ignored). Disaggregated: the first devices form the student mesh, the last ones the
  teacher mesh; together they must use every device exactly once."""
  if kind not in PLACEMENTS:
    raise ValueError(f"placement.teachers={kind!r}; expected one of {PLACEMENTS}")
  devices = list(jax.devices() if devices is None else devices)
  student_shape = {k: int(v) for k, v in dict(student_shape).items()}
  if kind == "colocated":
    mesh = sharding.make_mesh(student_shape, devices)
    return mesh, mesh
  if not teacher_shape:
    raise ValueError("placement.teachers='disaggregated' needs placement.teacher_mesh "
                     "(axis sizes of the teachers' sub-mesh)")
  teacher_shape = {k: int(v) for k, v in dict(teacher_shape).items()}
  n_s, n_t = math.prod(student_shape.values()), math.prod(teacher_shape.values())
  if n_s + n_t != len(devices):
    raise ValueError(f"student mesh {student_shape} ({n_s} devices) + teacher mesh "
                     f"{teacher_shape} ({n_t} devices) != {len(devices)} available devices")
  return (sharding.make_mesh(student_shape, devices[:n_s]),
          sharding.make_mesh(teacher_shape, devices[n_s:]))


def config_meshes(config, devices: Optional[Sequence] = None) -> tuple:
  """(student mesh, teacher mesh) of a RunConfig (mopd_jax.config.schema): `mesh` for the student,
  `placement` for the teachers."""
  return make_meshes(config.mesh, config.placement.teacher_mesh or None,
                     config.placement.teachers, devices=devices)


def stratified_sharding(mesh: Mesh, num_teachers: int, ndim: int = 3) -> NamedSharding:
  """[K, b, T] arrays: K over `teacher` when it divides, b over the batch axes."""
  t = mesh.shape.get("teacher", 1)
  lead = ("teacher",) if t > 1 and num_teachers % t == 0 else (None,)
  return sharding.batch_sharding(mesh, ndim, leading=lead)


def place_bank(bank: teachers.TeacherBank, mesh: Mesh) -> teachers.TeacherBank:
  """The bank's stacked params sharded onto `mesh` (teacher axis, then fsdp / tensor)."""
  sh = sharding.param_shardings(bank.model_cfg, mesh, num_stacked=bank.num_teachers)
  return bank.replace(params=jax.device_put(bank.params, sh))


class TeacherScorer:
  """Scores stratified batches with a bank placed on `teacher_mesh`; inputs and outputs live
  on `student_mesh`. Same mesh twice = co-located. `top_k` > 0 (the top-k distillation
  ablation): every call returns (log-probs, top-k log-probs [K, b, T, k], top-k ids)."""

  def __init__(self, bank: teachers.TeacherBank, student_mesh: Mesh, teacher_mesh: Mesh,
               *, chunk_size: int = 64, top_k: int = 0, tokenizer_hash: str = ""):
    """`tokenizer_hash`: the fingerprint of the tokenizer the bank's ids mean
    (`tokenizer.fingerprint`), which `info()` reports ("" when not given)."""
    if top_k < 0:
      raise ValueError(f"TeacherScorer top_k must be >= 0, got {top_k}")
    self.student_mesh, self.teacher_mesh = student_mesh, teacher_mesh
    self.tokenizer_hash = tokenizer_hash
    self.bank = place_bank(bank, teacher_mesh)
    k = bank.num_teachers
    self._in_t = stratified_sharding(teacher_mesh, k)
    self._in_s = stratified_sharding(student_mesh, k)
    out_t = self._in_t
    if top_k:  # the [K, b, T, k] outputs are laid out like the [K, b, T] ones
      out_t = (self._in_t,) + (stratified_sharding(teacher_mesh, k, ndim=4),) * 2
      self._in_s = (self._in_s,) + (stratified_sharding(student_mesh, k, ndim=4),) * 2
    bank_sh = jax.tree.map(lambda x: x.sharding, self.bank)
    # Jitted on the teacher mesh only: in the disaggregated placement no student device
    # takes part in (or holds a buffer of) the teacher prefill.
    self._score = jax.jit(
        lambda bank, t, m: teachers.score_stratified(bank, t, m, chunk_size=chunk_size,
                                                     top_k=top_k),
        in_shardings=(bank_sh, self._in_t, self._in_t), out_shardings=out_t)

  @property
  def disaggregated(self) -> bool:
    return self.student_mesh.devices.tolist() != self.teacher_mesh.devices.tolist()

  def submit(self, tokens_KxbxT, input_mask_KxbxT):
    """Dispatch scoring and return the (not yet ready) log-probs on the teacher mesh; JAX's
    async dispatch lets the caller go on sampling while the teacher devices work."""
    k = self.bank.num_teachers
    if tokens_KxbxT.shape[0] != k:
      raise ValueError(f"stratified batch has {tokens_KxbxT.shape[0]} teacher groups but the "
                       f"bank holds {k} teachers")
    if jax.process_count() > 1:  # host arrays -> global ones, each process its shards
      t, m = distributed.to_global((tokens_KxbxT, input_mask_KxbxT), self._in_t)
    else:
      t = jax.device_put(tokens_KxbxT, self._in_t)
      m = jax.device_put(input_mask_KxbxT, self._in_t)
    return self._score(self.bank, t, m)

  def fetch(self, logprobs_on_teacher):
    """Teacher-mesh log-probs -> the student mesh."""
    return jax.device_put(logprobs_on_teacher, self._in_s)

  def __call__(self, tokens_KxbxT, input_mask_KxbxT):
    return self.fetch(self.submit(tokens_KxbxT, input_mask_KxbxT))

  # --- the teacher-source interface (mopd_jax/teachers/source.py) ---------------------------
  def info(self) -> source.SourceInfo:
    cfg = self.bank.model_cfg
    return source.SourceInfo(
        kind="disaggregated" if self.disaggregated else "colocated",
        cells=tuple(self.bank.router.names), vocab_size=cfg.vocab_size,
        tokenizer_hash=self.tokenizer_hash, max_sequence=cfg.max_seq_len,
        max_logprobs=cfg.vocab_size)

  def score_probe(self, probe: source.Probe) -> dict:
    """{cell: [each probe row's log-probs]}, scored in one stratified call."""
    cells = tuple(self.bank.router.names)
    rows = max(sharding.batch_devices(self.student_mesh),
               sharding.batch_devices(self.teacher_mesh))
    tokens, mask = source.stratified_probe(probe, cells, row_multiple=rows)
    out = self(tokens, mask)
    return source.unstack_probe(distributed.gather(out[0] if isinstance(out, tuple) else out),
                                probe, cells)

