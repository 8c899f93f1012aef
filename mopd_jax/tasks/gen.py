"""`gen`, general reasoning: the sum of single digits modulo 3, with a running-sum scratchpad.

    prompt  2+1+0+2+0+1+1+2 mod 3 s4=2
    full    2,0,0,2,2,0,1,0\\n#0     the running sum mod 3 after every term
    brief   ~2,2,0,1,0\\n#0          from the memo on: the memo, then the running sum after
                                    each of the last four terms
    direct  #0                      the answer alone

The prompt ends with a *memo* `s4=v` claiming the sum of the first half of the terms mod 3;
like `agt`'s memo and `cod`'s comment it is stale (wrong) with probability `stale_prob`.

Why the styles differ in accuracy. The prompt has one term every 2 characters and full and
brief write one running value every 2 characters, so every step reads the previous value and
its term at the *same* relative offsets and applies one 9-entry table: easy to learn and the
same at every step. Full starts from the first term and is always right; brief starts from the
memo (a copy) and is right unless the memo is stale; direct has to add all the terms in one
go (a count with wrap-around, no shortcut), so it is close to chance (1/3). Every reference
solution is correct (brief's too: it writes the true half-sum), so where the memo is stale
the data disagree with it, and a model that copies it is right 1 - `stale_prob` of the time.
The three styles differ from their first token on (digit, `~`, `#`), so a policy that mixes
them (pi_SFT, whose effort token says nothing) commits to one style at its first step.

Why a memo. Measured with `experiments.measure_styles --domains gen` (style-tagged SFT of
the toy model), briefs without one stayed at the direct answer's accuracy: a value every
second term (0.39); one value per term without separators
(0.25 after 300 updates, 0.42 after 600: the stride to the prompt changes every step, and
only the first four values came out right); six values at the prompt's stride ending in a
three-term addition in the head (0.40); a memo of the *last* four terms added to the written
half-sum in the head (0.34). The toy model learns a copy and a constant stride within 200
updates, and an addition in the head not within 300-600: this brief reached 0.65 after 300
(direct 0.30, full 1.00).

Reward: 1.0 iff the integer after the last `#` is the sum modulo `modulus`.

`gen_pairs` (`--config.tasks.gen.task=gen_pairs`): the same problems with full and brief
writing each term before its running sum (`1120221000220221\n#1` for the terms 1,2,2,1,0,2,0,2;
brief `~0` and then the last four pairs), one character longer. A step of the `gen` trace
needs two inputs, its term (a far read at a fixed offset) and the previous value, neither of
which alone says anything about the next value (mod-3 addition), so SFT learns it through a
loss plateau of seed-dependent length; in `gen_pairs` the far read is a copy the loss
rewards at every step and the addition reads two neighbouring tokens. docs/toy_results.md
has the measured plateaus of both.
"""
from __future__ import annotations

import itertools

from mopd_jax.tasks import base


@base.register("gen")
class GenTask(base.Task):

  trace = "sums"  # full/brief scratchpad: "sums" (s1,s2,...) | "pairs" (t1 s1 t2 s2 ...)
  # Probability of a 0 term (the other values share the rest equally); None = uniform.
  zero_prob = base.ZERO_PROB

  def __init__(self, num_terms: int = 8, modulus: int = 3, stale_prob: float = 0.3):
    super().__init__()
    if not (2 <= modulus <= 10 and 4 <= num_terms <= 20):
      raise ValueError("need 2 <= modulus <= 10 and 4 <= num_terms <= 20")
    if not 0.0 <= stale_prob < 1.0:
      raise ValueError(f"stale_prob must be in [0, 1), got {stale_prob!r}")
    self.num_terms, self.modulus, self.stale_prob = num_terms, modulus, stale_prob

  def make(self, terms, memo=None, uid_seed: int = 0, *, index: int = 0) -> base.Example:
    """The example for `terms` whose prompt claims `memo` as the first half's sum mod m
    (None: the true one)."""
    terms = [int(t) for t in terms]
    m = self.modulus
    if len(terms) < 2 or not all(0 <= t < m for t in terms):
      raise ValueError(f"need at least 2 terms in [0, {m}), got {terms}")
    half = len(terms) // 2
    values = [v % m for v in itertools.accumulate(terms)]
    answer = str(values[-1])
    memo = values[half - 1] if memo is None else int(memo)
    if not 0 <= memo < m:
      raise ValueError(f"memo must be in [0, {m}), got {memo}")
    if self.trace == "pairs":
      steps = [f"{t}{v}" for t, v in zip(terms, values)]
      full = "".join(steps)
      brief = "~" + str(values[half - 1]) + "".join(steps[half:])
    else:
      full = ",".join(map(str, values))
      brief = "~" + ",".join(map(str, values[half - 1:]))
    solutions = dict(full=full + "\n#" + answer, brief=brief + "\n#" + answer,
                     direct="#" + answer)
    prompt = "+".join(map(str, terms)) + f" mod {m} s{half}={memo}"
    return base.make_example(self.name, uid_seed, index, prompt=prompt, answer=answer,
                             solutions=solutions,
                             meta=dict(terms=terms, values=values, memo=memo))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 1)
    for i in itertools.count():
      terms = base.draw_digits(rng, self.modulus, self.num_terms, zero_prob=self.zero_prob)
      memo = sum(terms[:self.num_terms // 2]) % self.modulus
      if rng.random() < self.stale_prob:
        memo = (memo + int(rng.integers(1, self.modulus))) % self.modulus
      yield self.make(terms, memo, seed, index=i)

  def problem_key(self, example: base.Example):
    """The terms: the memo does not change the answer."""
    return ("gen", tuple(example.meta["terms"]))

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.parse_int(base.final_answer(response))
    return float(got is not None and got == int(example.answer))

  def wrong_response(self, example: base.Example) -> str:
    """The full trace with the answer one off."""
    trace = example.solutions["full"].rsplit("#", 1)[0]
    return f"{trace}#{int(example.answer) + 1}"


@base.register("gen_pairs")
class GenPairsTask(GenTask):
  trace = "pairs"


@base.register("gen_uniform")
class GenUniformTask(GenTask):
  """`gen` with uniform terms: the step of the trace has no marginal signal (see the
  module docstring); kept to measure the plateau it gives."""
  zero_prob = None

