"""Teachers of several families in one run: each family (one tokenizer, one model shape) is
stacked in a bank of its own, and the run's teachers are those banks side by side.

A `MixedBank` routes every cell of the grid (its `router`, grid order, as one bank would)
and holds one `TeacherBank` per family (`parts`), each over its own cells in grid order;
`members[f]` are the run's teacher indices of family f's cells. A stratified [K, b, T]
batch (rows in each teacher's own tokens, padded to one width) is scored part by part: the
rows of family f's teachers by its bank, the log-probs put back in place
(`score_stratified`, `MixedScorer`). Only the sampled tokens' log-probs leave a part, so
the families' vocabularies never meet; losses that compare next-token distributions over
one vocabulary (`vocab_kl`, `topk`) are refused for such runs at config time.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax.io import tokenizer
from mopd_jax.runtime import distributed
from mopd_jax.teachers import bank as teachers, placement, source


@dataclasses.dataclass(frozen=True)
class Family:
  """One family of a run's teachers: its tokenizer (`tok`; the student's own object when it
  reads as the student's, `cross` False), the file it was read from ("" = the student's),
  its ModelConfig and its cells ("domain/effort", grid order)."""
  tok: Any
  path: str
  model_cfg: Any
  cells: tuple
  cross: bool


@dataclasses.dataclass(frozen=True)
class MixedBank:
  """The run's teachers as one bank per family (`parts[f]` routes `families[f].cells`) and a
  router over every cell (grid order). Duck-types the parts of `TeacherBank` the MOPD step
  reads: `router`, `num_teachers`, `params` (truthy when the parts hold params)."""
  parts: tuple
  router: teachers.Router
  families: tuple

  def __post_init__(self):
    covered = [c for f in self.families for c in f.cells]
    if sorted(covered) != sorted(self.router.names) or len(set(covered)) != len(covered):
      raise ValueError(f"the teacher families cover {covered}, not each of the cells "
                       f"{list(self.router.names)} once")
    for f, part in zip(self.families, self.parts):
      if tuple(part.router.names) != tuple(f.cells):
        raise ValueError(f"a family's bank routes {part.router.names}, its cells are {f.cells}")

  @property
  def num_teachers(self) -> int:
    return len(self.router.names)

  @property
  def params(self) -> tuple:
    """Each part's stacked params; empty when no part holds any (a router alone)."""
    return tuple(p.params for p in self.parts) if any(p.params for p in self.parts) else ()

  @property
  def members(self) -> tuple:
    """Per family, the run's teacher indices of its cells (ascending: grid order)."""
    names = list(self.router.names)
    return tuple(np.asarray([names.index(c) for c in f.cells], np.int64) for f in self.families)

  def family_of(self, k: int) -> int:
    """The family of the run's teacher k."""
    name = self.router.names[k]
    return next(i for i, f in enumerate(self.families) if name in f.cells)

  def teacher(self, k: int) -> tuple:
    """(params, ModelConfig, tokenizer) of the run's teacher k."""
    f = self.family_of(k)
    part, j = self.parts[f], self.families[f].cells.index(self.router.names[k])
    return (jax.tree.map(lambda x: x[j], part.params), part.model_cfg, self.families[f].tok)

  def tokenizers(self) -> tuple:
    """Each teacher's tokenizer, in router order."""
    return tuple(self.families[self.family_of(k)].tok for k in range(self.num_teachers))

  def map_parts(self, fn: Callable) -> "MixedBank":
    """The same bank with every part replaced by `fn(part)` (e.g. at a scoring temperature)."""
    return dataclasses.replace(self, parts=tuple(fn(p) for p in self.parts))


def is_mixed(bank) -> bool:
  return isinstance(bank, MixedBank)


def split_rows(bank: MixedBank, x_Kxb):
  """Per family, its teachers' rows of a stratified [K, b, ...] array."""
  return [x_Kxb[m] for m in bank.members]


def join_rows(bank: MixedBank, parts: Sequence, like_shape: tuple, *, dtype=np.float32):
  """The stratified [K, b, ...] array whose teachers' rows are `parts` (as `split_rows`)."""
  out = np.zeros(like_shape, dtype)
  for m, p in zip(bank.members, parts):
    out[m] = np.asarray(p)
  return out


def score_stratified(bank, tokens_KxbxT, input_mask_KxbxT, **kw):
  """`bank.score_stratified` for a TeacherBank or a MixedBank (each family's rows by its own
  bank); returns the [K, b, T] log-probs of the given tokens."""
  if not is_mixed(bank):
    return teachers.score_stratified(bank, tokens_KxbxT, input_mask_KxbxT, **kw)
  if kw.get("top_k"):
    raise ValueError("teachers of several families return sampled-token log-probs only "
                     "(no top-k over one vocabulary)")
  tokens, mask = np.asarray(tokens_KxbxT), np.asarray(input_mask_KxbxT)
  got = [teachers.score_stratified(part, t, m, **kw) for part, t, m in zip(
      bank.parts, split_rows(bank, tokens), split_rows(bank, mask))]
  return jnp.asarray(join_rows(bank, got, tokens.shape))


class MixedScorer:
  """`placement.TeacherScorer` for a MixedBank: one scorer per family, each scoring its
  teachers' rows of the stratified batch; `fetch` puts them back in place (on the host).
  Each family's scorer carries its tokenizer's fingerprint; the whole has none (`info`)."""

  def __init__(self, bank: MixedBank, student_mesh, teacher_mesh, *, chunk_size: int = 64):
    self.bank = bank
    hashes = [tokenizer.fingerprint(f.tok) for f in bank.families]
    self.parts = [placement.TeacherScorer(p, student_mesh, teacher_mesh, chunk_size=chunk_size,
                                          tokenizer_hash=h)
                  for p, h in zip(bank.parts, hashes)]

  @property
  def disaggregated(self) -> bool:
    return self.parts[0].disaggregated

  def submit(self, tokens_KxbxT, input_mask_KxbxT):
    """Dispatch every family's scoring (not blocking); the handle `fetch` takes."""
    k = self.bank.num_teachers
    if tokens_KxbxT.shape[0] != k:
      raise ValueError(f"stratified batch has {tokens_KxbxT.shape[0]} teacher groups but the "
                       f"bank holds {k} teachers")
    tokens, mask = np.asarray(tokens_KxbxT), np.asarray(input_mask_KxbxT)
    handles = [s.submit(t, m) for s, t, m in zip(
        self.parts, split_rows(self.bank, tokens), split_rows(self.bank, mask))]
    return tokens.shape, handles

  def fetch(self, submitted):
    """The [K, b, T] log-probs on the student mesh, laid out as one bank's scorer lays
    them out: each family's rows are gathered to the host (every process), put in place,
    and each process places its own shards (`distributed.to_global`)."""
    shape, handles = submitted
    got = [distributed.gather(s.fetch(h)) for s, h in zip(self.parts, handles)]
    joined = join_rows(self.bank, got, shape)
    out = placement.stratified_sharding(self.parts[0].student_mesh, shape[0])
    if jax.process_count() > 1:
      return distributed.to_global(joined, out)
    return jax.device_put(joined, out)

  def __call__(self, tokens_KxbxT, input_mask_KxbxT):
    return self.fetch(self.submit(tokens_KxbxT, input_mask_KxbxT))

  def score_probe(self, probe: source.Probe) -> dict:
    """{cell: [each probe row's log-probs]}: each family's cells by its own bank."""
    out = {}
    for f, part in zip(self.bank.families, self.parts):
      mine = {c: r for c, r in probe.rows.items() if c in f.cells}
      if mine:
        out.update(part.score_probe(source.Probe.of(mine)))
    return out

  def info(self) -> source.SourceInfo:
    infos = [s.info() for s in self.parts]
    return source.SourceInfo(
        kind=infos[0].kind, cells=tuple(self.bank.router.names),
        vocab_size=max(i.vocab_size for i in infos), tokenizer_hash="",
        max_sequence=min(i.max_sequence for i in infos),
        max_logprobs=min(i.max_logprobs for i in infos))
