"""`gen`, general reasoning: the running sum of 4-5 single-digit numbers, with a scratchpad.

    prompt  3+5+7+2=?
    full    3+5=8,8+7=15,15+2=17\\n#17     every addition written out (operands copied)
    brief   8,15,17\\n#17                  only the partial sums
    direct  #17                           the answer alone

Each full step is one table lookup (a number up to 45 plus one digit) with both operands
written right before it; brief has to find the next operand in the prompt while adding; the
direct style needs the whole 4-5 term sum in one step, which the ~1M-parameter toy model learns
far more slowly: reasoning length buys accuracy. 9^4 + 9^5 distinct prompts (digits 1-9).

Reward: 1.0 iff the integer after the last `#` equals the sum exactly.
"""
from __future__ import annotations

import itertools

from mopd_jax.tasks import base


class GenTask(base.Task):
  name = "gen"

  def __init__(self, min_terms: int = 4, max_terms: int = 5, lo: int = 1, hi: int = 9):
    super().__init__()
    if not 2 <= min_terms <= max_terms:
      raise ValueError("need 2 <= min_terms <= max_terms")
    if not 0 <= lo <= hi:
      raise ValueError("need 0 <= lo <= hi")
    self.min_terms, self.max_terms, self.lo, self.hi = min_terms, max_terms, lo, hi

  def make(self, numbers, uid_seed: int = 0, index: int = 0) -> base.Example:
    numbers = [int(v) for v in numbers]
    partial, steps, sums = numbers[0], [], []
    for v in numbers[1:]:
      steps.append(f"{partial}+{v}={partial + v}")
      partial += v
      sums.append(str(partial))
    answer = str(partial)
    solutions = dict(full=",".join(steps) + "\n#" + answer,
                     brief=",".join(sums) + "\n#" + answer,
                     direct="#" + answer)
    prompt = "+".join(map(str, numbers)) + "=?"
    return base.make_example(self.name, uid_seed, index, prompt, answer, solutions,
                             dict(numbers=numbers))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 1)
    for i in itertools.count():
      k = int(rng.integers(self.min_terms, self.max_terms + 1))
      yield self.make(rng.integers(self.lo, self.hi + 1, size=k), seed, i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.parse_int(base.final_answer(response))
    return float(got is not None and got == int(example.answer))
