"""`gen`, general reasoning: the sum of single digits modulo 3, with a running-sum scratchpad.

    prompt  2+1+0+2+0+1+1+2 mod 3
    full    2,0,0,2,2,0,1,0\\n#0     the running sum mod 3 after every term
    brief   ~0200\\n#0               after every second term
    direct  #0                      the answer alone

Why the styles differ in accuracy. The prompt has one term every 2 characters and full writes
one running value every 2 characters, so every full step reads the previous value and its term
at the *same* relative offsets and applies one 9-entry table: easy to learn and the same at
every step. A brief step adds two terms at once and its offsets to the prompt change from step
to step; direct has to add all the terms in one go (a count with wrap-around, no shortcut), so
it is close to chance (1/3). Longer reasoning buys accuracy. The three styles differ from
their first token on (digit, `~`, `#`), so a policy that mixes them (pi_SFT, whose effort
token says nothing) commits to one style at its first step instead of blending full and brief
values in one trace.

Reward: 1.0 iff the integer after the last `#` is the sum modulo `modulus`.
"""
from __future__ import annotations

import itertools

from mopd_jax.tasks import base


class GenTask(base.Task):
  name = "gen"

  def __init__(self, num_terms: int = 8, modulus: int = 3):
    super().__init__()
    if not (2 <= modulus <= 10 and 4 <= num_terms <= 20):
      raise ValueError("need 2 <= modulus <= 10 and 4 <= num_terms <= 20")
    self.num_terms, self.modulus = num_terms, modulus

  def make(self, terms, uid_seed: int = 0, index: int = 0) -> base.Example:
    terms = [int(t) for t in terms]
    m = self.modulus
    if len(terms) < 2 or not all(0 <= t < m for t in terms):
      raise ValueError(f"need at least 2 terms in [0, {m}), got {terms}")
    values = [v % m for v in itertools.accumulate(terms)]
    answer = str(values[-1])
    brief = values[1::2] if len(values) % 2 == 0 else values[1::2] + values[-1:]
    solutions = dict(full=",".join(map(str, values)) + "\n#" + answer,
                     brief="~" + "".join(map(str, brief)) + "\n#" + answer,
                     direct="#" + answer)
    prompt = "+".join(map(str, terms)) + f" mod {m}"
    return base.make_example(self.name, uid_seed, index, prompt, answer, solutions,
                             dict(terms=terms, values=values))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 1)
    for i in itertools.count():
      yield self.make(rng.integers(0, self.modulus, self.num_terms).tolist(), seed, i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.parse_int(base.final_answer(response))
    return float(got is not None and got == int(example.answer))
