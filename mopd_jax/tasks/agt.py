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

NAMES = tuple("abcdefghijklmnopqrstuvwxyz")  # one token each: lookups are single-token matches
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

  def __init__(self, num_people: int = 8, min_hops: int = 3, max_hops: int = 3,
               stale_prob: float = 0.2):
    super().__init__()
    if not 2 <= min_hops <= max_hops or not 2 * max_hops + 2 <= num_people <= len(NAMES):
      raise ValueError("need 2 <= min_hops <= max_hops and 2 * max_hops + 2 <= num_people "
                       "<= 26")
    if not 0.0 <= stale_prob < 1.0:
      raise ValueError(f"stale_prob must be in [0, 1), got {stale_prob!r}")
    self.num_people, self.min_hops, self.max_hops = num_people, min_hops, max_hops
    self.stale_prob = stale_prob
    self.environment = AgtEnvironment()

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
    full = "".join(calls) + "#" + answer
    # Brief calls the first hop, then follows the memo; the reference writes the true chain.
    brief = calls[0] + ">".join(chain[1:]) + "\n#" + answer
    solutions = dict(full=full, brief=brief, direct="#" + answer)
    meta = dict(boss=boss, chain=chain, memo=[list(m) for m in memo])
    return base.make_example(self.name, seed, index, prompt, answer, solutions, meta)

  def _stream(self, seed: int):
    rng = base.rng_for(seed, 2)
    for i in itertools.count():
      hops = int(rng.integers(self.min_hops, self.max_hops + 1))
      names = [NAMES[j] for j in rng.permutation(len(NAMES))[:self.num_people]]
      # The world: the question's chain c0 > ... > c_hops (the root), a decoy path of `hops`
      # people that joins the chain at the root, and everyone else under a random person.
      chain, decoy, rest = names[:hops + 1], names[hops + 1:2 * hops + 1], names[2 * hops + 1:]
      boss = {chain[-1]: None}
      for path in (chain, decoy + chain[-1:]):
        for a, b in zip(path, path[1:]):
          boss[a] = b
      for n in rest:
        placed = [m for m in boss if m != n]
        boss[n] = placed[int(rng.integers(0, len(placed)))]
      boss = dict(sorted(boss.items()))
      # The memo: hops 2.. of the chain (each stale, i.e. a wrong boss off the chain, with
      # probability stale_prob) and the decoy path's facts, in random order.
      off_chain = sorted(set(names) - set(chain))
      memo = []
      for a, b in zip(chain[1:], chain[2:]):
        if rng.random() < self.stale_prob:
          b = off_chain[int(rng.integers(0, len(off_chain)))]
        memo.append((a, b))
      memo += list(zip(decoy, decoy[1:]))
      memo = [memo[j] for j in rng.permutation(len(memo))]
      yield self.make(boss, chain[0], hops, memo, seed, i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.final_answer(response)
    return float(got is not None and got == example.answer)
