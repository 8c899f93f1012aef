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
from typing import Sequence

import numpy as np

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


def retokenize(student_tok, teacher_tok, response_ids) -> tuple:
  """(the teacher's token ids of the student's response, their `Alignment`): the response's
  text (its specials dropped) encoded by the teacher's tokenizer, and the student's end of
  response mapped to the teacher's (`eos_id` of each). Unalignable when the teacher's
  tokenizer cannot encode the text or its tokens do not reproduce it."""
  ids = [int(i) for i in response_ids]
  ended = bool(ids) and ids[-1] == student_tok.eos_id
  text = student_tok.decode(ids, skip_special=True)
  try:
    teacher_ids = list(teacher_tok.encode(text)) + ([teacher_tok.eos_id] if ended else [])
  except ValueError as e:  # a character the teacher's tokenizer does not have
    raise Unalignable(f"the teacher's tokenizer cannot encode the response: {e}") from None
  student_pieces = student_tok.token_bytes(ids)
  teacher_pieces = teacher_tok.token_bytes(teacher_ids)
  if b"".join(teacher_pieces) != text.encode("utf-8"):
    raise Unalignable("the teacher's tokens do not reproduce the response text")
  return teacher_ids, align(student_pieces, teacher_pieces)
