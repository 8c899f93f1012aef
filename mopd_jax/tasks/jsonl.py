"""Bring-your-own data: a JSONL file of `{"prompt", "answer", "domain"?, "budget"?}` records.

    data = load_jsonl("gsm8k_test.jsonl", max_prompt_len=1024, tokenizer=tok, on_too_long="skip")
    task = JsonlTask()
    task.verify(data.examples[0], "... so she pays 18 dollars.\\n#### 18")   # 1.0

Records. `prompt` (non-empty string) and `answer` (string or number) are required; `domain`
(a domain name, default `default_domain`) routes the example to its teachers; `budget`
(positive int) is b0 in tokens. Without `budget`, b0 is estimated from the answer: if the answer
holds reasoning (a `#` marker, GSM8K style `... #### 72`), b0 = ceil(1.1 * (its tokens + 1)),
like the toy tasks; otherwise `default_budget`. Lengths are in tokens of `tokenizer`, or
characters without one. Other keys are kept in `meta`.

Errors (DataError, a ValueError) name the file and the 1-based line: malformed JSON (also
nesting too deep to read and integers over Python's digit limit), a record that is not an
object, missing or mistyped fields, a non-finite answer, an empty prompt, an unknown domain,
bytes that are not UTF-8; a missing file names the path. A prompt over `max_prompt_len` raises (`on_too_long="error"`) or is skipped
and counted (`"skip"`); prompts are never truncated. Blank lines are ignored and counted.

Verifier: the response's final answer is the text after its last `#` or, failing that, after
its last `answer:` (case-insensitive); both sides are normalised (strip, lowercase, drop
commas, `$` and a trailing `.`) and compared as numbers when both parse as numbers, else as
strings. A reference answer holding `#` is reduced to the text after its last `#` first.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

from mopd_jax.io import storage
from mopd_jax.tasks import base

_ANSWER_RE = re.compile(r"answer\s*:", re.IGNORECASE)
_NUMBER_RE = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


@dataclasses.dataclass
class JsonlData:
  examples: list
  path: str
  num_lines: int = 0
  num_blank: int = 0  # whitespace-only lines, ignored
  num_skipped_too_long: int = 0
  skipped_lines: list = dataclasses.field(default_factory=list)  # 1-based line numbers


def _reference(answer: str) -> str:
  i = answer.rfind("#")
  return answer[i + 1:].strip() if i >= 0 else answer.strip()


def extract_answer(response: str) -> str | None:
  """Text after the last `#`, else after the last `answer:`, else None."""
  if not isinstance(response, str):
    return None
  fa = base.final_answer(response)
  if fa is not None:
    return fa
  matches = list(_ANSWER_RE.finditer(response))
  if not matches:
    return None
  return response[matches[-1].end():].strip().split("\n", 1)[0].strip()


def normalise(text: str) -> str:
  t = text.strip().lower().replace(",", "").replace("$", "").strip()
  while t.endswith("."):
    t = t[:-1].rstrip()
  return t


def answers_match(predicted: str | None, reference: str) -> bool:
  if predicted is None:
    return False
  p, r = normalise(predicted), normalise(_reference(reference))
  if not p:
    return False
  if _NUMBER_RE.fullmatch(p) and _NUMBER_RE.fullmatch(r):
    a, b = float(p), float(r)
    return math.isfinite(a) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
  return p == r


def iter_records(path: str):
  """(1-based line number, record dict or None for a blank line) of a JSONL file.

  Errors: DataError naming the file (and line): no such file or a directory, bytes that are
  not UTF-8, malformed JSON, nesting too deep, an unreadable value (an integer over Python's
  digit limit), a line that is not a JSON object."""
  path = os.fspath(path)
  where_file = storage.path(path)  # local or object storage (gs://...)
  if not where_file.is_file():
    raise base.DataError(f"{path}: no such file" + (" (a directory)" if where_file.is_dir()
                                                     else ""))
  with where_file.open("rb") as fh:
    for lineno, raw in enumerate(fh, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise base.DataError(f"{where}: not valid UTF-8 (byte {e.start}: "
                             f"{raw[e.start:e.start + 1]!r})") from None
      if not line.strip():
        yield lineno, None
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise base.DataError(f"{where}: malformed JSON: {e.msg} at column {e.colno}") from None
      except RecursionError:
        raise base.DataError(f"{where}: JSON nested too deeply to read") from None
      except ValueError as e:  # e.g. an integer over Python's digit limit
        raise base.DataError(f"{where}: unreadable JSON value: {e}") from None
      if not isinstance(rec, dict):
        raise base.DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
      yield lineno, rec


def load_jsonl(path: str, *, max_prompt_len: int | None = None, tokenizer=None,
               on_too_long: str = "error", default_domain: str = "gen",
               default_budget: int = 256, domains=None) -> JsonlData:
  """Reads a JSONL file into `Example`s (see the module docstring for the rules).
  `domains`: the domain names a record may carry (the run's grid); None = the registered
  tasks."""
  domains = tuple(base.registered() if domains is None else domains)
  if on_too_long not in base.ON_TOO_LONG:
    raise ValueError(f"on_too_long must be one of {base.ON_TOO_LONG}, got {on_too_long!r}")
  base.validate_domain(default_domain)
  if isinstance(default_budget, bool) or not isinstance(default_budget, int) or \
      default_budget <= 0:
    raise ValueError(f"default_budget must be a positive int, got {default_budget!r}")
  path = os.fspath(path)
  name = os.path.basename(path)
  out = JsonlData(examples=[], path=path)
  for lineno, rec in iter_records(path):
    out.num_lines = lineno

    def fail(msg, lineno=lineno):
      raise base.DataError(f"{path}:{lineno}: {msg}")

    if rec is None:
      out.num_blank += 1
      continue
    for key in ("prompt", "answer"):
      if key not in rec:
        fail(f"missing field {key!r}")
    prompt, answer = rec["prompt"], rec["answer"]
    if not isinstance(prompt, str):
      fail(f"'prompt' must be a string, got {type(prompt).__name__}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
      fail(f"'answer' must be a string or a number, got {type(answer).__name__}")
    if isinstance(answer, float) and not math.isfinite(answer):
      fail(f"'answer' must be a finite number, got {answer!r}")
    answer = str(answer)
    if not prompt.strip():
      fail("empty prompt")
    if not _reference(answer):
      fail("empty answer")
    domain = rec.get("domain", default_domain)
    if not isinstance(domain, str) or domain not in domains:
      fail(f"unknown domain {domain!r}; expected one of {list(domains)}")
    budget = rec.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget <= 0):
      fail(f"'budget' must be a positive int, got {budget!r}")
    try:
      base.check_text(prompt, "prompt"), base.check_text(answer, "answer")
      n = len(prompt) if tokenizer is None else base.num_tokens(prompt, tokenizer)
      if budget is None and "#" in answer:  # the answer holds reasoning: size b0 on it
        m = len(answer) if tokenizer is None else base.num_tokens(answer, tokenizer)
        budget = int(math.ceil(base.B0_MARGIN * (m + 1) - 1e-9))
      elif budget is None:
        budget = default_budget
    except ValueError as e:  # DataError, or a tokenizer refusing a character
      fail(str(e))
    if max_prompt_len is not None and n > max_prompt_len:
      if on_too_long == "error":
        unit = "characters" if tokenizer is None else "tokens"
        fail(f"prompt has {n} {unit}, over the maximum {max_prompt_len}")
      out.num_skipped_too_long += 1
      out.skipped_lines.append(lineno)
      continue
    ref = _reference(answer)
    solutions = {"direct": "#" + ref}
    if "#" in answer:
      solutions["full"] = answer
    meta = {k: v for k, v in rec.items() if k not in ("prompt", "answer", "domain", "budget")}
    meta["source"] = f"{name}:{lineno}"
    out.examples.append(base.Example(
        uid=f"{name}:{lineno}", domain=domain, prompt=prompt, b0=budget, answer=ref,
        solutions=solutions, meta=meta))
  return out


class JsonlTask(base.Task):
  """Verifier for JSONL examples (normalised final-answer match); no generator."""
  name = "jsonl"

  def _verify(self, example: base.Example, response: str) -> float:
    return float(answers_match(extract_answer(response), example.answer))
