"""The task interface shared by every domain: `Example`, `Task`, budgets, answer parsing.

An `Example` is plain, JSON-serialisable data (it round-trips through `to_json`/`from_json`,
which is how the TFDS builders store it). A `Task` generates examples deterministically from a
seed and scores responses with `verify`, which never raises: an exception inside a verifier
gives reward 0.0 and increments `Task.num_verify_errors`.

Budgets. `b0(x)` is measured in tokens of the toy `CharTokenizer`: the length of the example's
*full*-reasoning response plus one EOS token, times `B0_MARGIN` (1.1), rounded up. An effort with
`tau` gets `budget(example, tau) = floor(tau * b0)` tokens. The count includes observation tokens
(agt), so the full response fits whether or not a trainer counts them.

Response convention of the toy domains: free-form reasoning, then the final answer after a `#`
on the last line (`...\\n#147`); `final_answer` takes the text after the last `#`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable, Iterable, Sequence

from mopd_jax.config import choices
from mopd_jax.io.tokenizer import CharTokenizer

STYLES = ("full", "brief", "direct")  # reasoning styles of the reference solutions, longest first
B0_MARGIN = 1.1  # b0 = ceil(B0_MARGIN * (full-response tokens + 1 EOS))
ON_TOO_LONG = choices.ON_TOO_LONG

_CHAR_TOKENIZER = CharTokenizer()


class DataError(ValueError):
  """Bad input data (a malformed record, an empty or over-long prompt, undecodable bytes)."""


# --- the task registry -------------------------------------------------------------------
_REGISTRY: dict = {}


def register(name: str):
  """Class decorator: `@register("gen")` next to a Task's definition makes it the task of
  that name (`get_task(name)`, and a domain of a run config's `tasks` blocks)."""
  def deco(cls):
    if name in _REGISTRY and _REGISTRY[name] is not cls:
      raise ValueError(f"a task named {name!r} is already registered ({_REGISTRY[name]})")
    _REGISTRY[name] = cls
    cls.name = name
    return cls
  return deco


def registered() -> tuple:
  """The names of every registered task."""
  return tuple(sorted(_REGISTRY))


def get_task(name: str, domain: str | None = None, **kwargs) -> "Task":
  """A fresh instance (its own verifier counters) of the task registered as `name`.
  `domain`: the label its examples carry when a run's domain runs a task of another name
  (default: the task's own name)."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown task {name!r}; registered: {list(registered())}")
  task = _REGISTRY[name](**kwargs)
  if domain is not None and domain != name:
    task.name = validate_domain(domain)
  return task


def task_class(name: str) -> type:
  """The class registered as `name`."""
  if name not in _REGISTRY:
    raise ValueError(f"unknown task {name!r}; registered: {list(registered())}")
  return _REGISTRY[name]


def validate_domain(domain: str) -> str:
  """A domain label: a letter, then letters, digits or _ (the run's grid says which exist)."""
  if not (isinstance(domain, str) and domain.isidentifier()):
    raise ValueError(f"domain {domain!r} is not a valid domain name (a letter, then letters, "
                     "digits or _)")
  return domain


def check_text(text: Any, what: str = "text") -> str:
  """`text` if it is a str that encodes as UTF-8 (no lone surrogates); DataError otherwise."""
  if isinstance(text, (bytes, bytearray)):
    try:
      text = bytes(text).decode("utf-8")
    except UnicodeDecodeError as e:
      raise DataError(f"{what} is not valid UTF-8: {e}") from None
  if not isinstance(text, str):
    raise DataError(f"{what} must be a string, got {type(text).__name__}")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise DataError(f"{what} is not valid UTF-8 text: {e}") from None
  return text


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its labels. Every field is JSON-serialisable.

  uid: unique id within its dataset (e.g. "gen-3-17").
  domain: the domain it belongs to (the router's `d`).
  prompt: the prompt text, never empty.
  b0: base budget in tokens (see module docstring); the budget at effort e is tau_e * b0.
  answer: the reference final answer (what follows the `#` of a correct response).
  solutions: style -> reference response, styles a subset of STYLES (SFT data).
  meta: domain data, e.g. the hidden world (agt) or the hidden tests (cod).
  """
  uid: str
  domain: str
  prompt: str
  b0: int
  answer: str
  solutions: dict = dataclasses.field(default_factory=dict)
  meta: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    validate_domain(self.domain)
    check_text(self.prompt, "prompt")
    if not self.prompt.strip():
      raise DataError(f"example {self.uid!r}: empty prompt")
    if not (isinstance(self.b0, int) and self.b0 > 0):
      raise DataError(f"example {self.uid!r}: b0 must be a positive int, got {self.b0!r}")
    for style in self.solutions:
      if style not in STYLES:
        raise DataError(f"example {self.uid!r}: unknown style {style!r}; expected {STYLES}")

  def __hash__(self):  # the dict fields are unhashable; equal examples share these
    return hash((self.uid, self.domain, self.prompt))

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

  @classmethod
  def from_dict(cls, d: dict) -> "Example":
    return cls(**d)

  @classmethod
  def from_json(cls, s: str | bytes) -> "Example":
    return cls.from_dict(json.loads(s))


# --- budgets ---------------------------------------------------------------------------
def num_tokens(text: str, tokenizer=None) -> int:
  return len((tokenizer or _CHAR_TOKENIZER).encode(text))


def compute_b0(full_response: str, tokenizer=None) -> int:
  """Base budget: the full response's tokens + 1 (EOS), times B0_MARGIN, rounded up."""
  return int(math.ceil(B0_MARGIN * (num_tokens(full_response, tokenizer) + 1) - 1e-9))


def budget(example: Example, tau: float) -> int:
  """Token budget of `example` at an effort with multiplier `tau`: floor(tau * b0), >= 1."""
  if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
    raise ValueError(f"tau must be a positive finite number, got {tau!r}")
  return max(1, int(math.floor(tau * example.b0 + 1e-9)))


def effort_budget(example: Example, effort: str, taus: dict) -> int:
  """Budget at a named effort; `taus` maps effort name -> tau (from the config)."""
  if effort not in taus:
    raise ValueError(f"no tau configured for effort {effort!r}; have {sorted(taus)}")
  return budget(example, taus[effort])


def effort_budgets(examples: Iterable[Example], effort: str, taus: dict) -> list:
  """`effort_budget` of each of `examples`."""
  return [effort_budget(ex, effort, taus) for ex in examples]


def check_prompt_length(examples: Iterable[Example], max_len: int | None, *, tokenizer=None,
                        on_too_long: str = "error") -> tuple[list, int]:
  """(kept examples, number skipped). Length is in tokens of `tokenizer`, or characters if it
  is None. `on_too_long`: "error" raises DataError naming the example, "skip" drops and counts
  it. Prompts are never truncated."""
  if on_too_long not in ON_TOO_LONG:
    raise ValueError(f"on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}")
  kept, skipped = [], 0
  for ex in examples:
    n = len(ex.prompt) if tokenizer is None else num_tokens(ex.prompt, tokenizer)
    if max_len is not None and n > max_len:
      if on_too_long == "error":
        unit = "characters" if tokenizer is None else "tokens"
        raise DataError(f"example {ex.uid!r}: prompt has {n} {unit}, over the maximum "
                        f"{max_len}")
      skipped += 1
      continue
    kept.append(ex)
  return kept, skipped


# --- answers ---------------------------------------------------------------------------
_END_OF_TEXT = re.compile(r"<eos>|<pad>")


def final_answer(response: str) -> str | None:
  """The text after the last `#` (to the end of that line), or None if there is no `#`.

  Anything from the first `<eos>`/`<pad>` on is ignored (a decode that keeps specials)."""
  if not isinstance(response, str):
    return None
  m = _END_OF_TEXT.search(response)
  if m:
    response = response[:m.start()]
  i = response.rfind("#")
  if i < 0:
    return None
  return response[i + 1:].split("\n", 1)[0].strip()


_INT = re.compile(r"[+-]?\d+")


def parse_int(text: str | None) -> int | None:
  if text is None or not _INT.fullmatch(text.strip()) or len(text) > 100:
    return None
  return int(text)


# --- tasks -----------------------------------------------------------------------------
class Task:
  """A domain: deterministic example generation and a never-raising verifier.

  Subclasses set `name` and implement `_stream(seed)` (an endless iterator of examples) and
  `_verify(example, response) -> float`. `environment` is None except for tool-using domains,
  whose class names the four markers (call, call end, observation, observation end) of its
  tool calls in `tool_markers`: what the run's tokenizer must have. `generated`: its
  examples come from `generate` (False for a task of record files, `records`), so the data
  stage can build its TFDS config from the domain's name alone.
  """
  name: str = ""
  environment = None
  tool_markers: tuple = ()
  generated: bool = True

  @classmethod
  def run_options(cls, config, tokenizer) -> dict:
    """The keyword arguments this task's constructor takes from the run (its RunConfig and
    tokenizer) when the run context builds it (`Run.task`): none by default; a task that
    runs code takes the `sandbox` block, one that reads tool observations the tokenizer's
    markers."""
    del config, tokenizer
    return {}

  def __init__(self):
    self.num_verify_calls = 0
    self.num_verify_errors = 0  # verifier exceptions, each scored 0.0
    self.last_verify_error: str | None = None

  # generation
  def _stream(self, seed: int):
    raise NotImplementedError

  def wrong_response(self, example: Example) -> str:
    """A response in this task's format whose final answer is wrong: one `verify` must
    score 0 (the verifier contract tests of tests/test_tasks.py ask it of every task)."""
    raise NotImplementedError(f"task {self.name!r} gives no wrong_response")

  def problem_key(self, example: Example):
    """The example's underlying problem: examples with the same key have the same answer
    whatever else their prompts say (a memo, a comment). Held-out splits are disjoint from
    training by this key. Default: the prompt itself."""
    return example.prompt

  def generate(self, seed: int, n: int, exclude: Iterable[str] = (),
               *, exclude_problems: Iterable = ()) -> list[Example]:
    """`n` examples with distinct prompts, none in `exclude` and none whose `problem_key` is
    in `exclude_problems`; deterministic in (seed, n)."""
    if not (isinstance(n, int) and n >= 0):
      raise ValueError(f"n must be a non-negative int, got {n!r}")
    seen = set(exclude)
    problems = set(exclude_problems)
    out = []
    misses = 0
    for ex in self._stream(seed):
      if len(out) >= n:
        break
      if ex.prompt in seen or (problems and self.problem_key(ex) in problems):
        misses += 1
        if misses > 100 * n + 10_000:
          raise RuntimeError(f"{self.name}: cannot find {n} distinct prompts")
        continue
      seen.add(ex.prompt)
      out.append(ex)
    return out

  # verification
  def _verify(self, example: Example, response: str) -> float:
    raise NotImplementedError

  def verify(self, example: Example, response: str) -> float:
    """Reward in [0, 1]; never raises (an exception counts in `num_verify_errors`, gives 0)."""
    self.num_verify_calls += 1
    r, error = guarded_reward(self._verify, example, response)
    if error is not None:
      self.num_verify_errors += 1
      self.last_verify_error = error
    return r

  def verify_batch(self, examples: Sequence[Example], responses: Sequence[str]) -> list:
    if len(examples) != len(responses):
      raise ValueError(f"{len(examples)} examples but {len(responses)} responses")
    return [self.verify(ex, r) for ex, r in zip(examples, responses)]

  def verify_unless(self, examples: Sequence[Example], responses: Sequence[str], skip,
                    *, fill: float) -> list:
    """`verify_batch` of the rows not in `skip` (e.g. over budget), `fill` for the others;
    the verifier sees only the rows it scores."""
    keep = [i for i, s in enumerate(skip) if not s]
    scored = self.verify_batch([examples[i] for i in keep], [responses[i] for i in keep])
    out = [fill] * len(examples)
    for i, r in zip(keep, scored):
      out[i] = r
    return out

  def counters(self) -> dict:
    return dict(verify_calls=self.num_verify_calls, verify_errors=self.num_verify_errors)


def guarded_reward(fn: Callable[..., float], *args) -> tuple:
  """(fn(*args), None) for a reward in [0, 1]; (0.0, the error) when fn raises or returns
  anything else (NaN included). What every verifier wraps itself in, so it never raises."""
  try:
    r = float(fn(*args))
    if not 0.0 <= r <= 1.0:  # also catches NaN
      raise ValueError(f"verifier returned {r!r}, outside [0, 1]")
    return r, None
  except Exception as e:  # pylint: disable=broad-except
    return 0.0, f"{type(e).__name__}: {e}"[:300]


def make_example(task: str, seed: int, index: int, *, prompt: str, answer: str,
                 solutions: dict, meta: dict, tokenizer=None) -> Example:
  return Example(uid=f"{task}-{seed}-{index}", domain=task, prompt=prompt,
                 b0=compute_b0(solutions["full"], tokenizer), answer=answer,
                 solutions=dict(solutions), meta=meta)


def rng_for(seed: int, *salt: int):
  """A numpy Generator derived deterministically from (seed, *salt)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  return np.random.default_rng([int(seed) & 0xFFFFFFFF, *salt])


# The toy tasks' running sums mod 3 (`gen`'s terms, `cod`'s digits): a step's next value
# needs its digit and the previous value, and with uniform digits neither alone says anything
# about it (mod-3 addition), so SFT learns the step only after a loss plateau whose length
# varies with the seed and float rounding (docs/toy_results.md). With a 0 drawn half the
# time, the next value equals the previous one half the time: reading the previous value
# lowers the loss on its own, and once it is read the digit does too, so the step is learned
# without the plateau. The answer stays uniform to within 1e-4 (8 digits), so a guess is
# still right a third of the time.
ZERO_PROB = 0.5


def draw_digits(rng, base_: int, n: int, *, zero_prob) -> list:
  """`n` digits in [0, base_): 0 with probability `zero_prob` and the others equally likely
  (None: all uniform)."""
  if zero_prob is None:
    return [int(d) for d in rng.integers(0, base_, n)]
  p = [zero_prob] + [(1.0 - zero_prob) / (base_ - 1)] * (base_ - 1)
  return [int(d) for d in rng.choice(base_, n, p=p)]


VerifyFn = Callable[[Example, str], float]
