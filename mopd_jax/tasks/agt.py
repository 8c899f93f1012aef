"""`agt`, agents: multi-hop questions about a small hidden org chart, answered with tool calls.

Each example has its own hidden world: 8 people (3-letter names from a pool of 26) in a random
tree; `boss(name)` is the only tool. The prompt asks a 2- or 3-hop question and shows a short
*memo* of two `person>boss` facts: one about the *last* hop of the question's chain (stale,
i.e. naming a wrong boss, with probability `stale_prob`) and one true fact about someone off
the chain (a decoy; its boss is never the answer).

    prompt  memo: gus>hal,cal>dan\nboss(boss(boss(ann)))?
    full    <call>boss(ann)</call><obs>bob</obs>\n<call>boss(bob)</call><obs>cal</obs>\n
            <call>boss(cal)</call><obs>dan</obs>\nann>bob>cal>dan\n#dan
            (every hop called, the memo ignored, the chain recapped)
    brief   <call>boss(ann)</call><obs>bob</obs>\n<call>boss(bob)</call><obs>cal</obs>\n#dan
            (calls every hop but the last, then trusts the memo for the last one)
    direct  #dan   (no call; at best a guess between the memo's two facts)

The policy writes `<call>boss(ann)</call>`; the rollout pauses decoding at `</call>`, runs
`AgtEnvironment.step(example, "boss(ann)")` on the host and inserts its answer
`<obs>bob</obs>`; observation tokens are masked out of every loss and teacher log-prob.

Why the styles differ in accuracy. The reference answer is always the true one, but only full
can *know* it: brief reads the last hop from the memo, so a model that follows the brief style
is right only when that memo fact is not stale (about 1 - stale_prob of the time); direct does
not know which memo fact is on the chain (that needs the calls), so it is right about half as
often as brief.

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


class AgtTask(base.Task):
  name = "agt"

  def __init__(self, num_people: int = 8, min_hops: int = 2, max_hops: int = 3,
               stale_prob: float = 0.25):
    super().__init__()
    if not 4 <= num_people <= len(NAMES) or not 1 <= min_hops <= max_hops <= 3:
      raise ValueError("need 4 <= num_people <= 26 and 1 <= min_hops <= max_hops <= 3")
    self.num_people, self.min_hops, self.max_hops = num_people, min_hops, max_hops
    self.stale_prob = stale_prob
    self.environment = AgtEnvironment()

  def _world(self, rng) -> dict:
    """person -> boss (None for the root); always has a chain of depth >= 3."""
    names = [NAMES[i] for i in rng.permutation(len(NAMES))[:self.num_people]]
    boss = {names[0]: None}
    for i in range(1, self.num_people):
      boss[names[i]] = names[i - 1] if i <= 3 else names[int(rng.integers(0, i))]
    return dict(sorted(boss.items()))

  def make(self, boss: dict, start: str, hops: int, memo: list, seed: int = 0,
           index: int = 0) -> base.Example:
    """Builds the example for a world, a start person, a hop count and memo facts."""
    chain = [start]
    for _ in range(hops):
      chain.append(boss[chain[-1]])
    if None in chain:
      raise ValueError("chain runs past the root")
    answer = chain[-1]
    q = start
    for _ in range(hops):
      q = f"{TOOL}({q})"
    prompt = "memo: " + ",".join(f"{a}>{b}" for a, b in memo) + "\n" + q + "?"
    calls = [call_text(a) + obs_text(b) + "\n" for a, b in zip(chain, chain[1:])]
    full = "".join(calls) + ">".join(chain) + "\n#" + answer
    brief = "".join(calls[:-1]) + "#" + answer  # the last hop is read from the memo
    solutions = dict(full=full, brief=brief, direct="#" + answer)
    meta = dict(boss=boss, chain=chain, memo=[list(m) for m in memo])
    return base.make_example(self.name, seed, index, prompt, answer, solutions, meta)

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 2)
    for i in itertools.count():
      boss = self._world(rng)
      hops = int(rng.integers(self.min_hops, self.max_hops + 1))
      depth = {}
      for name in boss:
        d, p = 0, boss[name]
        while p is not None:
          d, p = d + 1, boss[p]
        depth[name] = d
      starts = sorted(n for n, d in depth.items() if d >= hops)
      start = starts[int(rng.integers(0, len(starts)))]
      chain = [start]
      for _ in range(hops):
        chain.append(boss[chain[-1]])
      answer = chain[-1]
      # Memo fact 1: the last hop, stale (a wrong boss, off the chain) with prob. stale_prob.
      last, told = chain[-2], answer
      off_chain = sorted(n for n in boss if n not in chain)
      if rng.random() < self.stale_prob:
        told = off_chain[int(rng.integers(0, len(off_chain)))]
      # Memo fact 2, the decoy: a fact among people off the chain (never naming the stale
      # boss): a true one when the world has one, else a made-up one.
      facts = [(n, boss[n]) for n in off_chain if boss[n] in off_chain and told not in (n, boss[n])]
      if facts:
        d, decoy_boss = facts[int(rng.integers(0, len(facts)))]
      else:
        free = [n for n in off_chain if n != told]  # >= 3 people: 8 minus a chain of <= 4
        j = rng.permutation(len(free))[:2]
        d, decoy_boss = free[int(j[0])], free[int(j[1])]
      memo = [(last, told), (d, decoy_boss)]
      memo = [memo[j] for j in rng.permutation(2)]
      yield self.make(boss, start, hops, memo, seed, i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.final_answer(response)
    return float(got is not None and got == example.answer)
