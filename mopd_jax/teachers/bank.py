"""The bank of frozen teachers and the (domain, effort) -> teacher router.

K teachers of one architecture are held as ONE stacked param pytree (leading axis = teacher
index), so scoring is a `vmap` over that axis and the axis can be sharded over a `teacher`
mesh axis: each teacher then lives on its own slice of devices. The bank is never part of
the optimizer state or of the student checkpoint, and every scoring path stops gradients.

Two scoring layouts:
  * stratified (`score_stratified`, the MOPD default): the batch is laid out [K, b, T] with
    b rows per teacher (`stratify` builds it); one `vmap` over teachers, compute O(K*b),
    params read once, shardable over the `teacher` axis.
  * routed (`teacher_logprobs`): a flat [B, T] batch with any mix of teacher ids, each row
    scored by its own teacher. Implemented as a scan over teachers that scores every row and
    keeps the rows it owns, so memory stays O(one teacher) but compute is O(K*B): use it for
    small banks, evaluation and unbalanced batches.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import models
from mopd_jax.io import checkpoint, storage
from mopd_jax.models import logprobs


@dataclasses.dataclass(frozen=True)
class Router:
  """Names like "gen/max" -> teacher index; domains and efforts are any strings."""

  names: tuple

  def __post_init__(self):
    for n in self.names:
      if n.count("/") != 1:
        raise ValueError(f"teacher name {n!r} must be 'domain/effort'")
    if len(set(self.names)) != len(self.names):
      raise ValueError(f"duplicate teacher names in {self.names}")

  @property
  def table(self) -> dict:
    return {tuple(n.split("/")): i for i, n in enumerate(self.names)}

  def index(self, domain: str, effort: str) -> int:
    try:
      return self.table[(domain, effort)]
    except KeyError:
      raise ValueError(f"no teacher for (domain={domain!r}, effort={effort!r}); "
                       f"bank has {list(self.names)}") from None

  def route(self, domains: Sequence[str], efforts: Sequence[str]) -> np.ndarray:
    if len(domains) != len(efforts):
      raise ValueError(f"{len(domains)} domains but {len(efforts)} efforts")
    return np.asarray([self.index(d, e) for d, e in zip(domains, efforts)], np.int32)


@flax.struct.dataclass
class TeacherBank:
  params: dict  # stacked: every leaf has a leading axis of size K
  model_cfg: models.ModelConfig = flax.struct.field(pytree_node=False)
  router: Router = flax.struct.field(pytree_node=False)

  @property
  def num_teachers(self) -> int:
    return len(self.router.names)


def check_compatible(student_cfg: models.ModelConfig, teacher_cfg: models.ModelConfig,
                     what: str = "teacher") -> None:
  """Teachers may be larger than the student but must share family and vocabulary."""
  if teacher_cfg.vocab_size != student_cfg.vocab_size:
    raise ValueError(f"{what} vocabulary size {teacher_cfg.vocab_size} differs from the "
                     f"student's vocabulary size {student_cfg.vocab_size}")
  if teacher_cfg.family != student_cfg.family:
    raise ValueError(f"{what} architecture family {teacher_cfg.family!r} differs from the "
                     f"student's {student_cfg.family!r}")


def build_bank(teacher_cfg: models.ModelConfig, teachers: Mapping[str, dict] | Sequence[dict],
               names: Optional[Sequence[str]] = None,
               *, student_cfg: Optional[models.ModelConfig] = None,
               sharding=None) -> TeacherBank:
  """Stack K param pytrees into a bank. `teachers`: {name: params} or a list with `names`
  ("domain/effort" each; a run's are its grid's, `grid.Grid.names`).

  `sharding`: optional pytree of shardings for the stacked params (see
  `sharding.param_shardings(..., leading_axes=("teacher",))`).
  """
  if isinstance(teachers, Mapping):
    names, plist = tuple(teachers), list(teachers.values())
  else:
    plist = list(teachers)
    if names is None:
      raise ValueError("a list of teacher params needs their names ('domain/effort' each)")
    names = tuple(names)
  if len(plist) != len(names):
    raise ValueError(f"{len(plist)} teacher param trees but {len(names)} names")
  if not plist:
    raise ValueError("a teacher bank needs at least one teacher")
  if student_cfg is not None:
    check_compatible(student_cfg, teacher_cfg)
  want = jax.eval_shape(lambda: models.init_params(teacher_cfg, jax.random.PRNGKey(0)))
  want_struct = jax.tree.structure(want)
  for name, p in zip(names, plist):
    if jax.tree.structure(p) != want_struct:
      raise ValueError(f"teacher {name!r} params do not match the teacher architecture")
    for w, x in zip(jax.tree.leaves(want), jax.tree.leaves(p)):
      if tuple(w.shape) != tuple(x.shape):
        raise ValueError(f"teacher {name!r} has a param of shape {tuple(x.shape)} where the "
                         f"architecture expects {tuple(w.shape)}")
  stacked = jax.tree.map(lambda *xs: jnp.stack([jax.lax.stop_gradient(x) for x in xs]), *plist)
  if sharding is not None:
    stacked = jax.device_put(stacked, sharding)
  return TeacherBank(params=stacked, model_cfg=teacher_cfg, router=Router(tuple(names)))


def score_stratified(bank: TeacherBank, tokens_KxbxT, input_mask_KxbxT, *,
                     chunk_size: int = 64, top_k: int = 0, topk_ids=None):
  """Teacher k scores rows [k]: returns [K, b, T] log-probs (and top-k if asked).

  One vmap over the stacked params; no gradient flows into the teachers.
  """
  params = jax.lax.stop_gradient(bank.params)
  k = bank.num_teachers
  if tokens_KxbxT.shape[0] != k:
    raise ValueError(f"stratified batch has {tokens_KxbxT.shape[0]} teacher groups but the "
                     f"bank holds {k} teachers")

  def one(p, t, m, ids):
    st = logprobs.token_stats(bank.model_cfg, p, t, input_mask=m, chunk_size=chunk_size,
                              top_k=top_k, topk_ids_BxTxK=ids)
    return st.logprobs if not top_k else (st.logprobs, st.topk_logprobs, st.topk_ids)

  if topk_ids is None:
    return jax.vmap(lambda p, t, m: one(p, t, m, None))(params, tokens_KxbxT, input_mask_KxbxT)
  return jax.vmap(one)(params, tokens_KxbxT, input_mask_KxbxT, topk_ids)


def teacher_logprobs(bank: TeacherBank, teacher_ids, tokens_BxT, *, input_mask_BxT=None,
                     chunk_size: int = 64):
  """[B, T] log-probs, row b scored by teacher `teacher_ids[b]` (routed layout)."""
  if input_mask_BxT is None:
    input_mask_BxT = jnp.ones(tokens_BxT.shape, bool)
  params = jax.lax.stop_gradient(bank.params)

  def step(acc, xs):
    k, p = xs
    lp = logprobs.token_logprobs(bank.model_cfg, p, tokens_BxT, input_mask=input_mask_BxT,
                                 chunk_size=chunk_size)
    return jnp.where((teacher_ids == k)[:, None], lp, acc), None

  init = jnp.zeros(tokens_BxT.shape, jnp.float32)
  out, _ = jax.lax.scan(step, init, (jnp.arange(bank.num_teachers), params))
  return out


def check_teacher_ids(teacher_ids, num_teachers: int) -> None:
  ids = np.asarray(teacher_ids)
  bad = ids[(ids < 0) | (ids >= num_teachers)]
  if bad.size:
    raise ValueError(f"teacher id {int(bad[0])} outside the bank [0, {num_teachers})")


def stratify(teacher_ids, num_teachers: int, rows_per_teacher: int):
  """Host-side layout: returns `index [K, b]` (row of the flat batch, -1 = padding).

  Row i goes to group teacher_ids[i]; each group is padded to b rows. Raises ValueError if
  a teacher has more rows than b (the batch is not stratifiable with that b).
  """
  check_teacher_ids(teacher_ids, num_teachers)
  ids = np.asarray(teacher_ids)
  index = np.full((num_teachers, rows_per_teacher), -1, np.int64)
  for k in range(num_teachers):
    rows = np.flatnonzero(ids == k)
    if len(rows) > rows_per_teacher:
      raise ValueError(f"teacher {k} has {len(rows)} rows, more than rows_per_teacher="
                       f"{rows_per_teacher}")
    index[k, :len(rows)] = rows
  return index


def gather_stratified(x_BxT, index_Kxb, fill=0):
  """[B, ...] -> [K, b, ...] by a stratify() index (padding rows get `fill`)."""
  x = np.asarray(x_BxT)
  safe = np.where(index_Kxb < 0, 0, index_Kxb)
  out = x[safe]
  out[index_Kxb < 0] = fill
  return out


def scatter_stratified(y_KxbxT, index_Kxb, batch_size: int):
  """Inverse of gather_stratified: [K, b, ...] -> [B, ...]."""
  y = np.asarray(y_KxbxT)
  out = np.zeros((batch_size,) + y.shape[2:], y.dtype)
  valid = index_Kxb >= 0
  out[index_Kxb[valid]] = y[valid]
  return out


# --- the teacher manifest (<workdir>/teachers.json) ------------------------------------------
# {"grid": Grid.to_json(), "teachers": {"d/e": entry}, ...}; an entry holds the teacher's
# checkpoint `path`, its `format` ("hf" for a Hugging Face checkpoint, else orbax), `tau`,
# `parent`, the student `model` signature it was trained with and its validation metrics; a
# teacher brought as a checkpoint also its `tokenizer` (file, fingerprint, vocabulary size,
# whether it is another than the student's: `sources.TeacherSource.tokenizer_record`).

def model_signature(cfg: models.ModelConfig) -> dict:
  """What a teacher must share with the student to be scored against it (manifest field)."""
  return {"family": cfg.family, "vocab_size": cfg.vocab_size, "num_layers": cfg.num_layers,
          "d_model": cfg.d_model}


def check_manifest_grid(manifest: dict, path: str, grid) -> None:
  """A manifest written for another task grid (domains, efforts or taus) is not this run's:
  ValueError naming both grids."""
  from mopd_jax.tasks.grid import Grid  # pylint: disable=g-import-not-at-top
  recorded = manifest.get("grid") if isinstance(manifest, dict) else None
  if recorded is not None and Grid.from_json(recorded) != grid:
    raise ValueError(f"teacher manifest {path} holds teachers trained on the "
                     f"{Grid.from_json(recorded).describe()}, but this run's is the "
                     f"{grid.describe()}; use another workdir, or the same domains, efforts "
                     "and taus")


def validate_manifest(manifest: dict, path: str, grid, *, student_cfg: models.ModelConfig,
                      resolve_hf=None, tokenizer: Optional[dict] = None,
                      cell_tokenizers: Optional[Mapping[str, dict]] = None) -> None:
  """The run's grid, every cell of it present, each checkpoint where the manifest says, and
  each teacher of the student's architecture family and vocabulary, or, with teachers of
  another tokenizer (`tokenizer["other"]`), a readable config of their own; raises naming
  the offending cells. `resolve_hf(path) -> ModelConfig` reads a Hugging Face teacher's
  config; `tokenizer`: the run's record of the teachers' tokenizer (`fingerprint`, `other`),
  which a teacher's recorded tokenizer must match; `cell_tokenizers`: {cell: record} where
  the cells' teachers read different tokenizers (several families)."""
  cells = manifest.get("teachers") if isinstance(manifest, dict) else None
  if not isinstance(cells, dict):
    raise ValueError(f"teacher manifest {path} has no 'teachers' mapping")
  check_manifest_grid(manifest, path, grid)
  names = grid.names
  missing = [n for n in names if n not in cells]
  if missing:
    raise FileNotFoundError(f"teacher manifest {path} lacks {missing} ({len(names)} cells "
                            f"{list(names)} are needed); run the rl stage")
  problems = []
  student = model_signature(student_cfg)
  for name in names:
    entry = cells[name]
    if cell_tokenizers is not None:
      tokenizer = cell_tokenizers[name]
    if not entry.get("path") or not storage.isdir(entry["path"]):
      problems.append(f"{name}: no checkpoint directory {entry.get('path')!r}")
    recorded = entry.get("tokenizer")
    if tokenizer and recorded and recorded.get("fingerprint") != tokenizer["fingerprint"]:
      problems.append(f"{name}: recorded with tokenizer {recorded.get('fingerprint')} "
                      f"({recorded.get('path') or 'the student'}'s), this run's teachers "
                      f"read with {tokenizer['fingerprint']} "
                      f"({tokenizer.get('path') or 'the student'}'s)")
    if entry.get("format") == "hf":
      try:
        cfg = resolve_hf(entry["path"])
        if not (tokenizer and tokenizer.get("other")):
          check_compatible(student_cfg, cfg, what=name)
      except (ValueError, OSError) as e:
        problems.append(f"{name}: {e}")
      continue
    sig = entry.get("model", student)  # an entry without the field is checked on load
    # rl-stage teachers are copies of pi_SFT: family, vocabulary and shape all match.
    diffs = [f"{k} {sig.get(k)!r} (student: {v!r})" for k, v in student.items()
             if sig.get(k) != v]
    if diffs:
      problems.append(f"{name}: " + ", ".join(diffs))
  if problems:
    raise ValueError(f"teacher manifest {path} is inconsistent with the student:\n  " +
                     "\n  ".join(problems))


def load_bank(path: str, grid, student_cfg: models.ModelConfig,
              *, teacher_cfg: models.ModelConfig, load_one, resolve_hf=None,
              sharding=None, tokenizer: Optional[dict] = None) -> TeacherBank:
  """The grid's teachers from the manifest at `path`: checked (`validate_manifest`, against
  the run's teachers' `tokenizer` record when given), each loaded with `load_one(entry) ->
  params`, stacked in the grid's order and placed with `sharding` (the stacked params'
  shardings)."""
  manifest = checkpoint.read_json(path)
  validate_manifest(manifest, path, grid, student_cfg=student_cfg, resolve_hf=resolve_hf,
                    tokenizer=tokenizer)
  plist = [load_one(manifest["teachers"][n]) for n in grid.names]
  other = bool(tokenizer and tokenizer.get("other"))  # another vocabulary: not checked
  return build_bank(teacher_cfg, plist, names=grid.names,
                    student_cfg=None if other else student_cfg,
                    sharding=sharding)


def teacher_table(manifest: dict) -> str:
  lines = ["teacher     tau   acc(val)  length  over-budget",
           "----------  ----  --------  ------  -----------"]
  for name, t in sorted(manifest["teachers"].items()):
    m = t["eval_validation"]
    if m is None:
      continue
    lines.append(f"{name:10s}  {t['tau']:.2f}  {m['accuracy']:8.3f}  {m['mean_length']:6.1f}  "
                 f"{m['over_budget_rate']:11.3f}")
  return "\n".join(lines)
