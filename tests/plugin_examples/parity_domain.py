"""A domain from outside the package: `par`, the parity of a bit string.

    prompt  1011001 parity
    full    1,1,0,1,0,0,1\n#0     the running parity after every bit
    brief   ~0,1\n#0             the parity of the first five bits, then the last two
    direct  #0

Registered with `tasks.base.register`; a run names it in `config.domains` once its module
is in `config.plugins`. Its one option, `num_bits`, is the constructor's keyword argument
(set in the run config's `tasks.par` block)."""
from __future__ import annotations

import itertools

from mopd_jax.tasks import base


@base.register("par")
class ParityTask(base.Task):

  def __init__(self, num_bits: int = 7):
    super().__init__()
    if not 3 <= num_bits <= 16:
      raise ValueError(f"num_bits must be in [3, 16], got {num_bits!r}")
    self.num_bits = num_bits

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 7)
    for i in itertools.count():
      bits = [int(b) for b in rng.integers(0, 2, self.num_bits)]
      running = [v % 2 for v in itertools.accumulate(bits)]
      answer = str(running[-1])
      cut = self.num_bits - 2
      solutions = dict(full=",".join(map(str, running)) + "\n#" + answer,
                       brief="~" + ",".join(map(str, running[cut - 1:])) + "\n#" + answer,
                       direct="#" + answer)
      yield base.make_example(self.name, seed, i, prompt="".join(map(str, bits)) + " parity",
                              answer=answer, solutions=solutions, meta=dict(bits=bits))

  def problem_key(self, example: base.Example):
    return ("par", tuple(example.meta["bits"]))

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.parse_int(base.final_answer(response))
    return float(got is not None and got == int(example.answer))

  def wrong_response(self, example: base.Example) -> str:
    return "#" + str(1 - int(example.answer))
