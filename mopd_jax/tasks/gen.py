"""`gen`, general reasoning: the sum of 3-4 two-digit numbers, with a scratchpad.

    prompt  23+45+67+12=?
    full    23+45=68,68+67=135,135+12=147\\n#147     every partial sum written out
    brief   68,135,147\\n#147                        only the partial sums
    direct  #147                                     the answer alone

Reward: 1.0 iff the integer after the last `#` equals the sum exactly. The direct style needs
a four-operand sum with carries in one step, which a ~1M-parameter model gets wrong far more
often than with the scratchpad: reasoning length buys accuracy.
"""
from __future__ import annotations

import itertools

from mopd_jax.tasks import base


class GenTask(base.Task):
  name = "gen"

  def __init__(self, min_terms: int = 3, max_terms: int = 4, lo: int = 10, hi: int = 99):
    super().__init__()
    if not 2 <= min_terms <= max_terms:
      raise ValueError("need 2 <= min_terms <= max_terms")
    self.min_terms, self.max_terms, self.lo, self.hi = min_terms, max_terms, lo, hi

  def make(self, numbers, uid_seed: int = 0, index: int = 0) -> base.Example:
    numbers = [int(v) for v in numbers]
    partial, steps = numbers[0], []
    sums = []
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
