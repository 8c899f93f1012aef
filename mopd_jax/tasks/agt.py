"""`agt`, agents: a 3-hop question about a small hidden org chart, answered with tool calls.

Each example has its own hidden world: 8 people (3-letter names from a pool of 26) in a tree;
`boss(name)` is the only tool. The prompt's first line is a *memo* of the first two levels
above the asker (`ann>bob>cal`: ann's boss is bob, whose boss is cal); it is stale (its last
name is wrong) with probability `stale_prob`. The question asks for the boss three levels up.

    prompt  ann>bob>cal\nboss(boss(boss(ann)))?
    full    <call>boss(ann)</call><obs>bob</obs>\n<call>boss(bob)</call><obs>cal</obs>\n
            <call>boss(cal)</call><obs>dan</obs>\n#dan      (every hop called, memo ignored)
    brief   ~<call>boss(cal)</call><obs>dan</obs>\n#dan     (memo trusted for two hops)
    direct  #dan                                             (no call: a guess)

The policy writes `<call>boss(ann)</call>`; the rollout pauses decoding at `</call>`, runs
`AgtEnvironment.step(example, "boss(ann)")` on the host and inserts its answer
`<obs>bob</obs>`; observation tokens are masked out of every loss and teacher log-prob.

Why the styles differ in accuracy. Every step of full and brief is a copy (a name from the
question, the memo or the last observation), but only full is always right: brief starts from
the memo's last name, so it is wrong whenever the memo is stale (`stale_prob`), and direct has
no way to know the answer (nobody above the memo is named in the prompt: about 1 in 8).

Reward: 1.0 iff the name after the last `#` is the true answer.
"""
from __future__ import annotations

import itertools
import re

from mopd_jax.tasks import base

NAMES = ("ada", "bob", "cal", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kai", "lea",
         "mia", "ned", "oli", "pam", "quy", "ray", "sam", "tom", "uma", "val", "wes", "xia",
         "yan", "zoe")
TOOL = "boss"
OBS_OPEN, OBS_CLOSE = "<obs>", "</obs>"
CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
NO_BOSS = "none"  # what boss(root) answers
# Brief's first token. Without it full and brief share their first tokens (`<call>boss(`)
# and part ways only at the name: RL at the high budget then pushes down `<call>` with every
# over-budget full sample, which takes brief's first token with it, and the direct answer's
# `#` gains first (agt/high chose the direct answer under 2 of the 3 RL settings tried).
# With it the three styles differ from their first token on, as in `gen`.
BRIEF_MARK = "~"
ERR_BAD_CALL = "error: bad call"
ERR_UNKNOWN = "error: unknown name"
_CALL_RE = re.compile(r"\s*" + TOOL + r"\(\s*([A-Za-z]{1,20})\s*\)\s*")


def call_text(name: str) -> str:
  return f"{CALL_OPEN}{TOOL}({name}){CALL_CLOSE}"


def obs_text(content: str) -> str:
  return f"{OBS_OPEN}{content}{OBS_CLOSE}"


class AgtEnvironment:
  """The tool server. Stateless: everything it needs is in `example.meta["boss"]`."""

  max_calls = 4  # a rollout should stop calling after this many turns (not enforced here)

  def step(self, example: base.Example, call: str) -> str:
    """Observation text (markers included) for one tool call; never raises.

    `call` is the text between `<call>` and `</call>` (the markers themselves are tolerated).
    Malformed calls and unknown names answer an error observation.
    """
    try:
      if not isinstance(call, str):
        return obs_text(ERR_BAD_CALL)
      call = call.strip()
      if call.startswith(CALL_OPEN):
        call = call[len(CALL_OPEN):]
      if call.endswith(CALL_CLOSE):
        call = call[:-len(CALL_CLOSE)]
      m = _CALL_RE.fullmatch(call)
      if not m:
        return obs_text(ERR_BAD_CALL)
      bosses = example.meta["boss"]
      name = m.group(1)
      if name not in bosses:
        return obs_text(ERR_UNKNOWN)
      return obs_text(bosses[name] or NO_BOSS)
    except Exception:  # pylint: disable=broad-except  (a broken example must not kill a rollout)
      return obs_text(ERR_BAD_CALL)


@base.register("agt")
class AgtTask(base.Task):
  tool_markers = (CALL_OPEN, CALL_CLOSE, OBS_OPEN, OBS_CLOSE)

  def __init__(self, num_people: int = 8, hops: int = 3, memo_hops: int = 2,
               *, stale_prob: float = 0.3):
    super().__init__()
    if not (1 <= memo_hops < hops and hops + 3 <= num_people <= len(NAMES)):
      raise ValueError("need 1 <= memo_hops < hops and hops + 3 <= num_people <= 26")
    if not 0.0 <= stale_prob < 1.0:
      raise ValueError(f"stale_prob must be in [0, 1), got {stale_prob!r}")
    self.num_people, self.hops, self.memo_hops = num_people, hops, memo_hops
    self.stale_prob = stale_prob
    self.environment = AgtEnvironment()

  def make(self, boss: dict, start: str, hops: int, *, memo: list, seed: int = 0,
           index: int = 0) -> base.Example:
    """The example for a world, a start person, a hop count and the memo chain (a list of
    names from `start`, read `A>B>C`: A's boss is B, whose boss is C)."""
    chain = [start]
    for _ in range(hops):
      chain.append(boss[chain[-1]])
    if None in chain:
      raise ValueError("chain runs past the root")
    if not memo or memo[0] != start or len(memo) > hops:
      raise ValueError(f"the memo must start at {start!r} and cover fewer than {hops} hops")
    answer = chain[-1]
    q = start
    for _ in range(hops):
      q = f"{TOOL}({q})"
    prompt = ">".join(memo) + "\n" + q + "?"
    calls = [call_text(a) + obs_text(b) + "\n" for a, b in zip(chain, chain[1:])]
    k = len(memo) - 1  # hops the memo claims to cover
    solutions = dict(full="".join(calls) + "#" + answer,
                     brief=BRIEF_MARK + "".join(calls[k:]) + "#" + answer,
                     direct="#" + answer)
    meta = dict(boss=boss, chain=chain, memo=list(memo))
    return base.make_example(self.name, seed, index, prompt=prompt, answer=answer,
                             solutions=solutions, meta=meta)

  def problem_key(self, example: base.Example):
    """The question's chain of bosses: the memo and the people off the chain do not change
    the answer."""
    return ("agt", tuple(example.meta["chain"]))

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 2)
    h, k = self.hops, self.memo_hops
    for i in itertools.count():
      names = [NAMES[j] for j in rng.permutation(len(NAMES))[:self.num_people]]
      # The world: the question's chain c0 > c1 > ... > c_h (the root), everyone else under
      # a random person already placed.
      chain, rest = names[:h + 1], names[h + 1:]
      boss = {chain[-1]: None}
      for a, b in zip(chain, chain[1:]):
        boss[a] = b
      for n in rest:
        placed = [m for m in boss if m != n]
        boss[n] = placed[int(rng.integers(0, len(placed)))]
      boss = dict(sorted(boss.items()))
      # The memo: the first k hops; when stale, its last name is someone off the chain.
      memo = chain[:k + 1]
      if rng.random() < self.stale_prob:
        memo = memo[:-1] + [rest[int(rng.integers(0, len(rest)))]]
      yield self.make(boss, chain[0], h, memo=memo, seed=seed, index=i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.final_answer(response)
    return float(got is not None and got == example.answer)

  def wrong_response(self, example: base.Example) -> str:
    """The full trace ending at another name of the boss table."""
    other = next(n for n in sorted(example.meta["boss"]) if n != example.answer)
    return example.solutions["full"].rsplit("#", 1)[0] + "#" + other
