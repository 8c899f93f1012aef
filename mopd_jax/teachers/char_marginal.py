"""Next-character targets from a teacher of another tokenizer, for a student that writes one
token per character: what the `char_kl` loss (mopd_jax/training/registry.py) distils at
every position of the student's own rollouts, its whole next-token distribution against the
teacher's, as `vocab_kl` does over one vocabulary.

The teacher gives probabilities to its own tokens, several characters each. The probability
it gives the character c after the response text s is read from the token paths that write
s + c: their last token starts at or before the end of s and reaches past it. The past is
tokenized as the teacher's encoding of the sampled response: with b its last token boundary
before the end of s and p the text from b to that end (the partial token),

    q(c | s)  ∝  sum_{t : t starts with p + c} P_T(t | ..b)                    (a token crosses)
               + P_T(p | ..b) * sum_{t' : t' starts with c} P_T(t' | ..b, p)    (p, then c)

At the start of a run of text (the response's start, after a special token or an
observation, where the teacher's encoding restarts) p is empty and q is the first-character
marginal of P_T(. | ..b). A special token of the student (its end of response, a tool
marker) is the second term's, P_T(p | ..b) P_T(special | ..b, p). The first term reads the
teacher's next-token distribution at b; the second the teacher's path through p and the
distribution after it: the sampled response's own next teacher position where its encoding
has a boundary at the end of s (p is then its token), otherwise a *branch*, the teacher's
prefix up to b followed by p in the teacher's tokens (the token p where the vocabulary has
it, else the encoder's tokens of p), scored as a row of its own. Every branch is scored:
dropping one leaves the characters only it reaches at probability 0, an unbounded KL for a
student that gives them any.

Left out, as every reading of a tokenizer's model by characters assumes: paths whose past
boundaries are not the sampled response's (another tokenization of s, or a boundary between
b and the end of s other than the end itself), to which a teacher trained on its encoder's
output gives little probability; a character a token boundary cuts (a multi-byte UTF-8
character split by a byte-level token), whose paths are dropped; and teacher tokens whose
next character the student cannot write (dropped, q renormalised over the student's
vocabulary).

Host work in numpy, except the teachers' passes (`next_logprobs`, one jitted program per
batch shape, every teacher of the bank in one vmap, their gradient stopped).
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from mopd_jax import models
from mopd_jax.rollout import turns as rollout
from mopd_jax.teachers import alignment, bank as teachers, char_served, families

_FLOOR = -1e3  # the log-prob of a character the teacher cannot write (the top-k losses' floor)


class NotCharacterLevel(ValueError):
  """A student tokenizer with an ordinary token of more or less than one character."""


def _chars(piece: bytes):
  """(offset, bytes) of each whole UTF-8 character of a token's bytes; bytes of a character
  the token cuts are skipped."""
  i = 0
  while i < len(piece):
    lead = piece[i]
    n = 1 if lead < 0x80 else 2 if lead >> 5 == 6 else 3 if lead >> 4 == 14 else \
        4 if lead >> 3 == 30 else 0
    if n and i + n <= len(piece):
      try:
        piece[i:i + n].decode("utf-8")
        yield i, piece[i:i + n]
      except UnicodeDecodeError:
        pass
    i += max(n, 1)


class CharTable:
  """The two vocabularies as the targets read them: the student's id of each character, the
  teacher's tokens that extend each partial token p (`ext[p]`: their ids and the student id
  of the character after p), the teacher's token that is p itself (`exact`), and the special
  tokens both have (by role). NotCharacterLevel for a student with an ordinary token that is
  not one character."""

  def __init__(self, student_tok, teacher_tok):
    self.v_s, self.v_t = int(student_tok.vocab_size), int(teacher_tok.vocab_size)
    s_roles = rollout.special_roles(student_tok)
    char_id = {}
    for i, piece in enumerate(student_tok.token_bytes(range(self.v_s))):
      if i in s_roles or not piece:
        continue
      try:
        one = len(piece.decode("utf-8")) == 1
      except UnicodeDecodeError:
        one = False
      if not one:
        raise NotCharacterLevel(
            f"the student's token {i} ({piece!r}) is not one character: the char_kl loss "
            "needs a student that writes one token per character")
      char_id.setdefault(piece, i)
    t_roles = rollout.special_roles(teacher_tok)
    s_of_role = {r: i for i, r in s_roles.items()}
    pairs = sorted((t, s_of_role[r]) for t, r in t_roles.items() if r in s_of_role)
    self.special_t = np.asarray([t for t, _ in pairs], np.int64)
    self.special_s = np.asarray([s for _, s in pairs], np.int64)
    ext, self.exact = {}, {}
    for t, piece in enumerate(teacher_tok.token_bytes(range(self.v_t))):
      if t in t_roles or not piece:
        continue
      self.exact.setdefault(piece, t)
      for off, ch in _chars(piece):
        if ch in char_id:
          ids, chars = ext.setdefault(piece[:off], ([], []))
          ids.append(t)
          chars.append(char_id[ch])
    self.ext = {p: (np.asarray(i, np.int64), np.asarray(c, np.int64))
                for p, (i, c) in ext.items()}

  def crossing(self, lp_t, partial: bytes) -> np.ndarray:
    """[V_s] the first term's mass on each student token, exp(lp_t) summed over the
    teacher's tokens that extend `partial` by that character (float64; 0 for specials)."""
    out = np.zeros(self.v_s)
    if partial in self.ext:
      ids, chars = self.ext[partial]
      np.add.at(out, chars, np.exp(np.asarray(lp_t, np.float64)[ids]))
    return out

  def first(self, lp_t) -> np.ndarray:
    """[V_s] the next token's mass by its first character, and each special the student
    has by role (float64): the distribution after a boundary."""
    out = self.crossing(lp_t, b"")
    out[self.special_s] += np.exp(np.asarray(lp_t, np.float64)[self.special_t])
    return out


@dataclasses.dataclass(frozen=True)
class Target:
  """One loss position's recipe: student response index `i`; the teacher's response token
  `m` whose predicting distribution is the one at b; the partial token `partial` (b"" at a
  run's start); where the path through the partial token comes from: the response's own
  token m (`after_main`), a branch of the teacher's tokens `branch` after its prefix up to
  b, or neither (False and ())."""
  i: int
  m: int
  partial: bytes
  after_main: bool = False
  branch: tuple = ()


def plan_row(table: CharTable, student_tok, teacher_tok, *, ids, gen_mask) -> list:
  """The `Target`s of one response's generated tokens (`alignment.moved_runs`'s runs);
  Unalignable as `retokenize_response` says."""
  out, tm, prev = [], 0, None  # prev: the last generated text run (its teacher start, pieces)
  for run in alignment.moved_runs(student_tok, teacher_tok, [int(i) for i in ids],
                                  gen_mask=[int(g) for g in gen_mask]):
    gen = bool(gen_mask[run.start])
    if run.kind == "special":
      if gen and prev is None:
        out.append(Target(run.start, tm, b""))
      elif gen:  # the run before it ends at a boundary: its last token is the partial one
        base, pieces = prev
        out.append(Target(run.start, base + len(pieces) - 1, pieces[-1], after_main=True))
      prev = None
    elif gen:
      starts = np.concatenate([[0], np.cumsum([len(p) for p in run.dst_pieces])])
      text = b"".join(run.dst_pieces)
      offset = 0
      for i, piece in zip(range(run.start, run.end), run.src_pieces):
        if offset == 0:
          out.append(Target(i, tm, b""))
        else:
          j = int(np.searchsorted(starts, offset, side="left")) - 1  # last start < offset
          partial = text[starts[j]:offset]
          if starts[j + 1] == offset:
            out.append(Target(i, tm + j, partial, after_main=True))
          else:
            out.append(Target(i, tm + j, partial, branch=_branch(table, teacher_tok, partial)))
        offset += len(piece)
      prev = (tm, run.dst_pieces)
    else:
      prev = None
    tm += len(run.dst_ids)
  return out


def _branch(table: CharTable, teacher_tok, partial: bytes) -> tuple:
  """The teacher's tokens of a partial token's text: the one token that is it, else the
  encoder's; () for bytes that are not whole characters."""
  if partial in table.exact:
    return (table.exact[partial],)
  try:
    return tuple(int(t) for t in teacher_tok.encode(partial.decode("utf-8")))
  except (UnicodeDecodeError, ValueError):
    return ()


@functools.partial(jax.jit, static_argnames=("cfg",))
def next_logprobs(cfg: models.ModelConfig, params_K, tokens_KxnxT, *, mask_KxnxT, at_KxnxA):
  """[K, n, A, V] each teacher's log-softmax next-token distribution after the positions
  `at` of its rows (teacher k scores rows [k]; gradient stopped)."""
  def one(p, rows):  # one teacher's params and its (tokens, mask, positions)
    tok, m, at = rows
    c, p = models.materialize(cfg, p)
    h = models.hidden_states(c, p, tok, input_mask=m)
    h = jnp.take_along_axis(h, at[..., None], axis=1)
    return jax.nn.log_softmax(models.logits_from_hidden(c, p, h), axis=-1)
  return jax.vmap(one)(jax.lax.stop_gradient(params_K), (tokens_KxnxT, mask_KxnxT, at_KxnxA))


def _next_of(bank):
  """`fn(tokens, *, mask_KxnxT, at_KxnxA)` -> [K, n, A, V] the bank's teachers' next-token
  log-probs after the positions `at` of their rows: the jitted pass on the bank's params
  in this process, or the servers' top-k (`char_served.Served`)."""
  if isinstance(bank, char_served.Served):
    return bank.next_logprobs
  return lambda *args, **kw: next_logprobs(bank.model_cfg, bank.params, *args, **kw)


def targets(bank: teachers.TeacherBank, sampled, table: CharTable, *, student_tok,
            teacher_tok) -> tuple:
  """([B, T, V_s] the teachers' next-character log-probs on the student's positions of
  `sampled` (a `mopd.SampledBatch` of teachers of another tokenizer), [B, T] where they are
  set (the generated tokens of the rows the teacher could take), counts {"char_branches":
  the branches scored, "char_positions": the positions set})."""
  arr, index, spans = sampled.arr, np.asarray(sampled.index), sampled.spans
  n_rows, width = arr["tokens"].shape
  tokens, mask = np.asarray(sampled.tokens), np.asarray(sampled.input_mask)
  k_of, slot_of = {}, {}
  for k, slot in zip(*np.nonzero(index >= 0)):
    k_of[int(index[k, slot])], slot_of[int(index[k, slot])] = int(k), int(slot)
  at = np.broadcast_to(np.arange(tokens.shape[-1], dtype=np.int32), tokens.shape)
  main = np.asarray(_next_of(bank)(tokens, mask_KxnxT=mask, at_KxnxA=at))
  plans = {}
  for r, a in enumerate(sampled.alignments or ()):
    if a is None or r not in k_of:
      continue
    ps, _, n = spans[r]
    try:
      plans[r] = plan_row(table, student_tok, teacher_tok, ids=arr["tokens"][r, ps:ps + n],
                          gen_mask=arr["loss_mask"][r, ps:ps + n])
    except alignment.Unalignable:
      continue
  branches = {}
  for r, plan in plans.items():
    for tg in plan:
      if tg.branch:
        branches.setdefault((r, tg.m, tg.branch), len(branches))
  scored = _score_branches(bank, branches, tokens=tokens, k_of=k_of, slot_of=slot_of,
                           spans=spans)
  out = np.zeros((n_rows, width, table.v_s), np.float32)
  ok = np.zeros((n_rows, width), bool)
  for r, plan in plans.items():
    ps, pt, _ = spans[r]
    row = main[k_of[r], slot_of[r]]
    for tg in plan:
      lp = row[pt + tg.m - 1]  # the distribution of the teacher's token m: at b
      if not tg.partial:
        mass = table.first(lp)
      else:
        mass = table.crossing(lp, tg.partial)
        if tg.after_main:  # the response's own token m is the partial token
          mass = mass + np.exp(float(lp[tokens[k_of[r], slot_of[r], pt + tg.m]])) * \
              table.first(row[pt + tg.m])
        elif tg.branch:
          rest, after = scored[branches[(r, tg.m, tg.branch)]]
          mass = mass + np.exp(float(lp[tg.branch[0]]) + rest) * table.first(after)
      total = mass.sum()
      if not total > 0:
        continue
      with np.errstate(divide="ignore"):
        out[r, ps + tg.i] = np.maximum(np.log(mass / total), _FLOOR)
      ok[r, ps + tg.i] = True
  return out, ok, {"char_branches": len(branches), "char_positions": int(ok.sum())}


def _score_branches(bank, branches: dict, *, tokens, k_of, slot_of, spans) -> list:
  """Per branch (row r's teacher prefix up to its token m, then the branch's tokens), scored
  by row r's teacher: (the summed log-probs of the branch's tokens after its first, the
  distribution after its last). Stratified by teacher, the count and width bucketed."""
  if not branches:
    return []
  k_n = tokens.shape[0]
  per = [[] for _ in range(k_n)]
  for (r, m, ids), j in branches.items():
    per[k_of[r]].append((j, r, m, ids))
  # Powers of two of rows and multiples of 32 of width: few shapes, few compiles.
  nb = rollout.padded_width(max(len(p) for p in per), pow2=True, floor=8)
  steps = max(len(ids) for _, _, ids in branches)
  w = rollout.padded_width(max(spans[r][1] + m + len(ids) for r, m, ids in branches), 32)
  tok = np.zeros((k_n, nb, w), np.int32)
  msk = np.zeros((k_n, nb, w), bool)
  at = np.zeros((k_n, nb, steps), np.int32)
  for k, rows in enumerate(per):
    for s, (_, r, m, ids) in enumerate(rows):
      cut = spans[r][1] + m
      tok[k, s, :cut] = tokens[k, slot_of[r], :cut]
      tok[k, s, cut:cut + len(ids)] = ids
      msk[k, s, :cut + len(ids)] = True
      at[k, s] = np.minimum(cut + np.arange(steps), cut + len(ids) - 1)
  got = np.asarray(_next_of(bank)(tok, mask_KxnxT=msk, at_KxnxA=at))
  out = [None] * len(branches)
  for k, rows in enumerate(per):
    for s, (j, _, _, ids) in enumerate(rows):
      rest = sum(float(got[k, s, l - 1, ids[l]]) for l in range(1, len(ids)))
      out[j] = (rest, got[k, s, len(ids) - 1])
  return out


_TABLES: dict = {}


def table_for(student_tok, teacher_tok) -> CharTable:
  """The `CharTable` of two tokenizers, built once per pair of objects."""
  key = (id(student_tok), id(teacher_tok))
  if key not in _TABLES:
    _TABLES[key] = (student_tok, teacher_tok, CharTable(student_tok, teacher_tok))
  return _TABLES[key][2]


def topk_of(bank, sampled) -> tuple:
  """((the teachers' next-character log-probs [B, T, V_s], their ids, every student token
  at every position), the batch's loss mask where they are set, counts as `targets` and
  `char_seconds`, the wall time of building them): the
  top-k inputs of the `char_kl` loss for a `mopd.SampledBatch` whose `tokenizers` are
  (the student's, the teachers'). Teachers of several families (`bank` a
  `families.MixedBank`, `tokenizers[1]` each teacher's): each family's rows by its own
  bank and tokenizer (a family of the student's tokenizer gives its teacher's next-token
  distribution, which is its next-character one). Teachers behind servers (`bank` a
  `char_served.Served`): their top-k, each family's through its own client."""
  if sampled.tokenizers is None:
    raise ValueError("the char_kl loss needs teachers of another tokenizer "
                     "(teacher.tokenizer_path): the batch has no alignment to read")
  s_tok, t_tok = sampled.tokenizers
  t = time.perf_counter()
  inner = bank.bank if isinstance(bank, char_served.Served) else bank
  if families.is_mixed(inner):
    tokens, mask = np.asarray(sampled.tokens), np.asarray(sampled.input_mask)
    lp, ok, counts = 0.0, False, {"char_branches": 0, "char_positions": 0}
    parts = ([bank.family(f.cells) for f in inner.families]
             if isinstance(bank, char_served.Served) else bank.parts)
    for part, fam, m in zip(parts, inner.families, inner.members):
      rows = dataclasses.replace(sampled, index=np.asarray(sampled.index)[m],
                                 tokens=tokens[m], input_mask=mask[m])
      got, set_, n = targets(part, rows, table_for(s_tok, fam.tok), student_tok=s_tok,
                             teacher_tok=fam.tok)
      lp, ok = lp + got, ok | set_  # a row is one family's: zero elsewhere
      counts = {k: counts[k] + n[k] for k in counts}
  else:
    lp, ok, counts = targets(bank, sampled, table_for(s_tok, t_tok), student_tok=s_tok,
                             teacher_tok=t_tok)
  ids = np.broadcast_to(np.arange(lp.shape[-1], dtype=np.int32), lp.shape)
  counts["char_seconds"] = time.perf_counter() - t  # the teachers' passes and the host work
  return (lp, ids), np.asarray(sampled.arr["loss_mask"]) & ok, counts
