"""Rewards across tokenizers: a teacher of another tokenizer scores the student's response
text in its own tokens; the per-token log-ratio of K3 eq. 15 becomes a per-span one.

Both tokenizations cover the same response bytes. A *span* is a shortest run of bytes on
which both have a token boundary at each end: the common boundaries of the two
tokenizations' byte offsets cut the response into spans, each holding whole tokens of both
(one token each where the tokenizations agree). Byte offsets, not characters: a byte-level
tokenizer may cut inside a multi-byte UTF-8 character, and such a cut is simply not common
to the two, so the character's bytes fall in one span.

For span j, the log-ratio is d_j = sum of the teacher's log-probs of its tokens minus the
student's of its tokens, so that sum_j d_j = log p_teacher(y) - log p_student(y) exactly;
the reward is r_j = clip(d_j, -r_max, r_max), one clip per span. It reaches the student's
tokens of the span by one of two rules (`assign`):
  * "spread" (the default): each of the span's n_j student tokens gets r_j / n_j. The span's
    log-ratio belongs to the span's tokens jointly (its probability is their product), so
    each gets an equal share; the per-token scale stays eq. 15's and the row's rewards sum to
    the span rewards' sum.
  * "last": the span's last student token gets r_j, the others 0 (the reward arrives when
    the span is complete, as a sparse per-token signal would).
Where every span is one token of each (the same tokenizer), both rules give eq. 15's
clip(log pi_T(y_t) - log pi(y_t)) exactly. A response the teacher's tokenizer cannot encode
(an unknown token, bytes that do not round-trip) has no alignment: `Unalignable`, and the
row gets no reward (the stage counts it).

Pure numpy on the host: it runs beside the teachers' prefill.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from mopd_jax.rollout import turns as rollout

ASSIGN_RULES = ("spread", "last")


class Unalignable(ValueError):
  """Two tokenizations that do not cover the same bytes (a token the tokenizer cannot
  encode, or text that does not round-trip)."""


@dataclasses.dataclass(frozen=True)
class Alignment:
  """Spans of one response: span j covers the student's tokens
  [student[j], student[j + 1]) and the teacher's [teacher[j], teacher[j + 1])."""
  student: np.ndarray  # int [S + 1] token boundaries, 0 first, the student's count last
  teacher: np.ndarray  # int [S + 1]

  @property
  def num_spans(self) -> int:
    return len(self.student) - 1

  def multi_token_share(self) -> float:
    """The share of the teacher's tokens in spans of two or more characters' worth of the
    student's tokens (how far the two tokenizations differ)."""
    s, t = np.diff(self.student), np.diff(self.teacher)
    return float(t[s > 1].sum() / max(t.sum(), 1))


def byte_ends(pieces: Sequence) -> np.ndarray:
  """Each token's end offset in bytes, from the tokens' bytes (`bytes`, or `str` taken as
  UTF-8); Unalignable for a token with no bytes of its own (None: unknown)."""
  ends, total = [], 0
  for i, p in enumerate(pieces):
    if p is None:
      raise Unalignable(f"token {i} has no bytes (an unknown token)")
    total += len(p.encode("utf-8") if isinstance(p, str) else bytes(p))
    ends.append(total)
  return np.asarray(ends, np.int64)


def align(student_pieces: Sequence, teacher_pieces: Sequence) -> Alignment:
  """The spans of two tokenizations of one text, each given as its tokens' bytes in order.
  A token of zero bytes joins the span it ends in. Unalignable when they cover different
  byte counts."""
  s_end, t_end = byte_ends(student_pieces), byte_ends(teacher_pieces)
  s_total = int(s_end[-1]) if len(s_end) else 0
  t_total = int(t_end[-1]) if len(t_end) else 0
  if s_total != t_total:
    raise Unalignable(f"the tokenizations cover {s_total} and {t_total} bytes")
  common = np.intersect1d(s_end, t_end)
  common = common[common > 0]
  # A boundary after the last token ending at each common offset (zero-byte tokens at a
  # boundary go with the span before it).
  s_cut = np.searchsorted(s_end, common, side="right")
  t_cut = np.searchsorted(t_end, common, side="right")
  s_cut[-1:] = len(s_end)
  t_cut[-1:] = len(t_end)
  return Alignment(np.concatenate([[0], s_cut]).astype(np.int64),
                   np.concatenate([[0], t_cut]).astype(np.int64))


def span_log_ratios(alignment: Alignment, student_logprobs, teacher_logprobs) -> np.ndarray:
  """d_j per span: the teacher's summed log-probs of the span's tokens minus the
  student's (float64 sums; float32 out)."""
  s = np.concatenate([[0.0], np.cumsum(np.asarray(student_logprobs, np.float64))])
  t = np.concatenate([[0.0], np.cumsum(np.asarray(teacher_logprobs, np.float64))])
  a, b = alignment.student, alignment.teacher
  return ((t[b[1:]] - t[b[:-1]]) - (s[a[1:]] - s[a[:-1]])).astype(np.float32)


def token_rewards(alignment: Alignment, student_logprobs, teacher_logprobs, *, r_max: float,
                  assign: str = "spread") -> np.ndarray:
  """The student's per-token rewards [S] (see the module docstring): each span's clipped
  log-ratio spread over its student tokens, or put on its last one. Where every span is
  one token of each, exactly eq. 15's clip(lp_teacher - lp_student)."""
  if assign not in ASSIGN_RULES:
    raise ValueError(f"assign must be one of {ASSIGN_RULES}, got {assign!r}")
  lp_s = np.asarray(student_logprobs, np.float32)
  lp_t = np.asarray(teacher_logprobs, np.float32)
  a, b = alignment.student, alignment.teacher
  counts = np.diff(a)
  if not len(counts):  # an empty response: nothing to reward
    return np.zeros(len(lp_s), np.float32)
  if (counts == 1).all() and (np.diff(b) == 1).all():  # one token each: eq. 15 itself
    return np.clip(lp_t - lp_s, -r_max, r_max)
  r = np.clip(span_log_ratios(alignment, lp_s, lp_t), -r_max, r_max)
  out = np.zeros(len(lp_s), np.float32)
  if assign == "last":
    out[a[1:] - 1] = r
  else:
    out[:] = np.repeat(r / np.maximum(counts, 1), counts)
  return out


def _segments(roles: dict, ids: Sequence[int], gen_mask: Sequence[int]):
  """The response cut into runs: (kind, start, end) with kind "special" (one token) or
  "text" (a maximal run of ordinary tokens of one gen_mask value)."""
  out, start = [], 0
  for i in range(len(ids) + 1):
    cut = i == len(ids) or ids[i] in roles or (i > start and gen_mask[i] != gen_mask[start])
    if cut and i > start:
      out.append(("text", start, i))
      start = i
    if i < len(ids) and ids[i] in roles:
      out.append(("special", i, i + 1))
      start = i + 1
  return out


def retokenize_response(src_tok, dst_tok, ids: Sequence[int], *,
                        gen_mask: Sequence[int]) -> tuple:
  """(ids, gen_mask, `Alignment`) of a response moved from `src_tok`'s tokens to
  `dst_tok`'s: each run of ordinary tokens (cut at special tokens and where generated text
  meets an observation) decoded and encoded again by `dst_tok`, each special token (end of
  response, tool markers, an effort token) replaced by `dst_tok`'s token of the same role.
  The alignment's spans never cross a run: a special token is a span of one token each.
  Unalignable when `dst_tok` has no token for a special's role, cannot encode a run's text,
  or its tokens do not reproduce it. To the same tokenizer the response stays as sampled
  (a span per token), never re-encoded: a sampled tokenization need not be the one the
  tokenizer's encoder writes, and the teacher must score the sequence the student drew."""
  ids = [int(i) for i in ids]
  gen_mask = [int(g) for g in gen_mask]
  if len(gen_mask) != len(ids):
    raise ValueError(f"gen_mask has {len(gen_mask)} entries for {len(ids)} ids")
  if dst_tok is src_tok:
    cuts = np.arange(len(ids) + 1, dtype=np.int64)
    return ids, gen_mask, Alignment(cuts, cuts.copy())
  out_ids, out_gen, s_cuts, t_cuts = [], [], [0], [0]
  for run in moved_runs(src_tok, dst_tok, ids, gen_mask=gen_mask):
    if run.kind == "special":
      s_cuts.append(run.end)
      t_cuts.append(len(out_ids) + 1)
    else:
      local = align(run.src_pieces, run.dst_pieces)
      s_cuts.extend(run.start + local.student[1:])
      t_cuts.extend(len(out_ids) + local.teacher[1:])
    out_ids.extend(run.dst_ids)
    out_gen.extend([gen_mask[run.start]] * len(run.dst_ids))
  return out_ids, out_gen, Alignment(np.asarray(s_cuts, np.int64), np.asarray(t_cuts, np.int64))


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a response moved into another tokenizer: the source's tokens [start, end),
  a special token ("special", one token) or text of one gen_mask value ("text"), and its
  tokens in the destination tokenizer with both sides' bytes (b"" for a special)."""
  kind: str
  start: int
  end: int
  dst_ids: list
  src_pieces: list
  dst_pieces: list


def moved_runs(src_tok, dst_tok, ids: Sequence[int], *, gen_mask: Sequence[int]):
  """Yield the `Run`s of a response (`retokenize_response`'s cut): each special token
  replaced by `dst_tok`'s of its role, each text run decoded and encoded again. Unalignable
  as `retokenize_response` says."""
  src_roles = rollout.special_roles(src_tok)
  dst_of = {role: i for i, role in rollout.special_roles(dst_tok).items()}
  for kind, a, b in _segments(src_roles, ids, gen_mask):
    if kind == "special":
      role = src_roles[ids[a]]
      if role not in dst_of:
        raise Unalignable(f"the teacher's tokenizer has no token for {role!r}")
      yield Run("special", a, b, [dst_of[role]], [b""], [b""])
      continue
    text = src_tok.decode(ids[a:b], skip_special=True)
    try:
      run = list(dst_tok.encode(text))
    except ValueError as e:  # a character the other tokenizer does not have
      raise Unalignable(f"the teacher's tokenizer cannot encode the response: {e}") from None
    src_pieces, dst_pieces = src_tok.token_bytes(ids[a:b]), dst_tok.token_bytes(run)
    if b"".join(dst_pieces) != text.encode("utf-8") or any(i in dst_of.values() for i in run):
      raise Unalignable("the teacher's tokens do not reproduce the response text")
    yield Run("text", a, b, run, list(src_pieces), list(dst_pieces))


def retokenize(student_tok, teacher_tok, response_ids) -> tuple:
  """(the teacher's token ids of the student's response, their `Alignment`) for a response
  of generated tokens only (`retokenize_response` with every token generated)."""
  t_ids, _, a = retokenize_response(student_tok, teacher_tok, response_ids,
                                    gen_mask=[1] * len(response_ids))
  return t_ids, a


def teacher_logprobs_on_student(alignment: Optional[Alignment], student_logprobs,
                                teacher_logprobs, *, gen_mask, r_max: float,
                                assign: str = "spread") -> np.ndarray:
  """[S] what eq. 15 reads as the teacher's log-prob of each of the student's response
  tokens when the teacher has another tokenizer. On a span of one token of each, the
  teacher's log-prob of its token as it is, so eq. 15 computes its own clipped r_t there
  exactly as for a teacher of the student's tokenizer; on a longer span, the student's
  log-prob plus the token's share of the span's clipped reward (`token_rewards`), so that
  r_t = lp_T - lp_S is that share. Off the generated tokens, and on a row with no alignment
  (None: the teacher could not take it), the student's log-prob itself (reward 0)."""
  lp_s = np.asarray(student_logprobs, np.float32)
  out = lp_s.copy()
  if alignment is None:
    return out
  lp_t = np.asarray(teacher_logprobs, np.float32)
  r = token_rewards(alignment, lp_s, lp_t, r_max=r_max, assign=assign)
  a, b = alignment.student, alignment.teacher
  single = np.repeat((np.diff(a) == 1) & (np.diff(b) == 1), np.diff(a))
  mapped = np.zeros(len(lp_s), np.int64)
  mapped[a[:-1]] = b[:-1]  # a span's first student token -> its first teacher token
  gen = np.asarray(gen_mask, bool)
  out = np.where(gen & single, lp_t[np.minimum(mapped, max(len(lp_t) - 1, 0))]
                 if len(lp_t) else lp_s, np.where(gen, lp_s + r, lp_s))
  return out.astype(np.float32)


def cross_view(tok, teacher_tok, trajs: Sequence[rollout.Trajectory], *, examples: Sequence,
               width_multiple: int, shown: Sequence[Optional[str]]) -> tuple:
  """(padded arrays, spans, alignments) of the student's trajectories as teachers of another
  tokenizer score them: each response moved into the teacher's tokens
  (`retokenize_response`: its text re-encoded, its end of response and tool
  markers the teacher's own, observations still masked) after the example's prompt as the
  teacher's tokenizer renders it (its own chat template) with the effort `shown` gives.
  `teacher_tok`: the teachers' tokenizer, or a sequence of one per row (teachers of several
  families; each row padded with its own pad id). A response the teacher cannot take keeps
  an empty response (alignment None). `spans[i]`: (student response start, teacher response
  start, student response length)."""
  per_row = isinstance(teacher_tok, (list, tuple))
  toks = list(teacher_tok) if per_row else [teacher_tok] * len(trajs)
  rows, spans, aligned = [], [], []
  for t, ex, e, ttok in zip(trajs, examples, shown, toks):
    prompt = rollout.encode_prompt(ttok, ex, e)
    try:
      ids, gen, a = retokenize_response(tok, ttok, t.ids, gen_mask=t.gen_mask)
    except Unalignable:
      ids, gen, a = [], [], None
    rows.append(rollout.Trajectory(prompt, ids, gen, [0.0] * len(ids)))
    spans.append((len(t.prompt_ids), len(prompt), t.num_tokens))
    aligned.append(a)
  width = rollout.padded_width(max(len(r.prompt_ids) + r.num_tokens for r in rows),
                               width_multiple)
  arr = rollout.pad_batch(rows, toks[0].pad_id, width)
  if per_row:  # each row's padding in its own vocabulary
    pads = np.asarray([tt.pad_id for tt in toks], np.int32)[:, None]
    arr["tokens"] = np.where(arr["input_mask"], arr["tokens"], pads).astype(np.int32)
  return arr, spans, aligned


def cross_teacher_logprobs(arr: dict, rows_BxT, *, spans, alignments, r_max: float,
                           assign: str) -> np.ndarray:
  """[B, T] on the student's positions of the padded batch `arr`, what eq. 15 reads as the
  teachers' log-probs when they have another tokenizer (`teacher_logprobs_on_student`): the
  sampled log-prob plus each token's share of its span's clipped reward, from the teachers'
  per-token log-probs `rows_BxT` on their own layout (`cross_view`'s `spans` and
  `alignments`, one per real row)."""
  lp_s = np.asarray(arr["sampler_logprobs"], np.float32)
  out = lp_s.copy()
  for i, a in enumerate(alignments):
    ps, pt, n = spans[i]
    n_t = 0 if a is None else int(a.teacher[-1])
    out[i, ps:ps + n] = teacher_logprobs_on_student(
        a, lp_s[i, ps:ps + n], rows_BxT[i, pt:pt + n_t],
        gen_mask=arr["loss_mask"][i, ps:ps + n], r_max=r_max, assign=assign)
  return out
