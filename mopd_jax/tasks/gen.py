"""`gen`, general reasoning: the sum of single digits modulo 3, with a running-sum scratchpad.

    prompt  t=0 2+1+0+2+0+1+1+2 mod 3
    full    2,0,0,2,2,0,1,0\n#0     the running sum mod 3 after every term
    brief   ~2,0+0\n#0              the running sum of the first `head` terms, then the note
    direct  #0                      the answer alone

The prompt starts with a note `t=` that claims the sum mod 3 of the terms after the first
`head`; it is stale (wrong) with probability `stale_prob`, like `cod`'s comment and `agt`'s
memo. At the start, not the end: the note then sits outside every full step's reach, whose
offsets to its term stay what they were without a note (with the note at the end, full was
learned after 300-450 gen updates instead of 50-70, too late for the pipeline's SFT).

Why the styles differ in accuracy. The prompt has one term every 2 characters and full writes
one running value every 2 characters, so every full step reads the previous value and its term
at the *same* relative offsets and applies one 9-entry table: easy to learn and the same at
every step. Brief writes the first `head` values of that trace, copies the note after a `+`
and adds the two: right unless the note is stale. Direct has to add the terms in its head (a
count with wrap-around, no shortcut; at best the first `head` terms plus the note), so it is
far below full. Longer reasoning buys accuracy (README, "Toy tasks"). The three styles differ
from their first token on (digit, `~`, `#`), so a policy that mixes them (pi_SFT, whose
effort token says nothing) commits to one style at its first step.

Every solution ends with the true answer (the SFT data is correct), so brief's answer
disagrees with its own trace and note when the note is stale: a model learns the rule that is
right most of the time. Two earlier briefs were not learned within the toy's SFT: the value
after every second term (0.38, as direct), and the head values then the answer with the note
added silently (0.47 after 600 updates); writing the note into the trace (`+t`) makes the last
step the same local table lookup as every full step (0.70 after 450).

Reward: 1.0 iff the integer after the last `#` is the sum modulo `modulus`.
"""
from __future__ import annotations

import itertools

from mopd_jax.tasks import base


class GenTask(base.Task):
  name = "gen"

  # head 2: brief ("~v,v+t\n#a" and <eos>, 10 tokens) fits the high budget of 8 terms,
  # floor(0.55 * ceil(1.1 * 19)) = 11 tokens; a third value would not.
  def __init__(self, num_terms: int = 8, modulus: int = 3, head: int = 2,
               stale_prob: float = 0.2):
    super().__init__()
    if not (2 <= modulus <= 10 and 4 <= num_terms <= 20 and 1 <= head < num_terms):
      raise ValueError("need 2 <= modulus <= 10, 4 <= num_terms <= 20, 1 <= head < num_terms")
    if not 0.0 <= stale_prob < 1.0:
      raise ValueError(f"stale_prob must be in [0, 1), got {stale_prob!r}")
    self.num_terms, self.modulus, self.head, self.stale_prob = (num_terms, modulus, head,
                                                                stale_prob)

  def make(self, terms, claimed_tail: int | None = None, uid_seed: int = 0,
           index: int = 0) -> base.Example:
    """The example of `terms`; `claimed_tail`: the note's claim of the sum mod m of the terms
    after the first `head` (None: the true sum)."""
    terms = [int(t) for t in terms]
    m, head = self.modulus, self.head
    if len(terms) <= head or not all(0 <= t < m for t in terms):
      raise ValueError(f"need more than {head} terms in [0, {m}), got {terms}")
    values = [v % m for v in itertools.accumulate(terms)]
    tail = sum(terms[head:]) % m
    claimed = tail if claimed_tail is None else int(claimed_tail)
    if not 0 <= claimed < m:
      raise ValueError(f"claimed_tail must be in [0, {m}), got {claimed_tail}")
    answer = str(values[-1])
    solutions = dict(full=",".join(map(str, values)) + "\n#" + answer,
                     brief="~" + ",".join(map(str, values[:head])) + f"+{claimed}\n#" + answer,
                     direct="#" + answer)
    prompt = f"t={claimed} " + "+".join(map(str, terms)) + f" mod {m}"
    return base.make_example(self.name, uid_seed, index, prompt, answer, solutions,
                             dict(terms=terms, values=values, claimed_tail=claimed,
                                  stale=claimed != tail))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 1)
    m = self.modulus
    for i in itertools.count():
      terms = rng.integers(0, m, self.num_terms).tolist()
      tail = sum(terms[self.head:]) % m
      stale = rng.random() < self.stale_prob
      claimed = (tail + int(rng.integers(1, m))) % m if stale else tail
      yield self.make(terms, claimed, seed, i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.parse_int(base.final_answer(response))
    return float(got is not None and got == int(example.answer))
