"""`gen`, general reasoning: track a ball under five cups through six swaps (a shell game, like
BIG-bench's "tracking shuffled objects").

    prompt  ball at A, swaps AB CD BD AE DC BE
    full    B, B, D, D, C, C\\n#C     where the ball is after every swap
    brief   B, D\\n#C                 after every second swap
    direct  #C                       the final cup alone

Why full is easy: the prompt lists one swap every 3 characters and full writes one position
every 3 characters, so each step reads the previous position and its swap at the *same*
relative offsets, and applies one tiny rule (the ball moves iff its cup is in the swap). Brief
composes two swaps per step; direct has to compose all six at once, and the swaps do not
commute, so there is no shortcut. 5 * 20^6 distinct prompts.

Reward: 1.0 iff the cup letter after the last `#` is the ball's final cup.
"""
from __future__ import annotations

import itertools

from mopd_jax.tasks import base

CUPS = "ABCDEFGHIJ"


def track(start: str, swaps) -> list:
  """The ball's cup after each swap (each swap a two-letter string)."""
  pos, out = start, []
  for s in swaps:
    pos = s[1] if pos == s[0] else s[0] if pos == s[1] else pos
    out.append(pos)
  return out


class GenTask(base.Task):
  name = "gen"

  def __init__(self, num_cups: int = 5, num_swaps: int = 6):
    super().__init__()
    if not 3 <= num_cups <= len(CUPS) or not 2 <= num_swaps <= 12:
      raise ValueError(f"need 3 <= num_cups <= {len(CUPS)} and 2 <= num_swaps <= 12")
    self.num_cups, self.num_swaps = num_cups, num_swaps

  def make(self, start: str, swaps, uid_seed: int = 0, index: int = 0) -> base.Example:
    swaps = [str(s) for s in swaps]
    if any(len(s) != 2 or s[0] == s[1] for s in swaps):
      raise ValueError(f"each swap must be two different cups, got {swaps}")
    path = track(start, swaps)
    answer = path[-1]
    solutions = dict(full=", ".join(path) + "\n#" + answer,
                     brief=", ".join(path[1:-1:2]) + "\n#" + answer,
                     direct="#" + answer)
    prompt = f"ball at {start}, swaps " + " ".join(swaps)
    return base.make_example(self.name, uid_seed, index, prompt, answer, solutions,
                             dict(start=start, swaps=swaps, path=path))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 1)
    cups = CUPS[:self.num_cups]
    for i in itertools.count():
      start = cups[int(rng.integers(0, self.num_cups))]
      swaps = ["".join(cups[j] for j in rng.permutation(self.num_cups)[:2])
               for _ in range(self.num_swaps)]
      yield self.make(start, swaps, seed, i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.final_answer(response)
    return float(got is not None and got == example.answer)
