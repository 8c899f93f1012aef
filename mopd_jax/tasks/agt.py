"""`agt`, agents: multi-hop questions about a small hidden org chart, answered with tool calls.

Each example has its own hidden world: 8 people (3-letter names from a pool of 26) in a random
tree; `boss(name)` is the only tool. The prompt asks a 2- or 3-hop question and shows a short
*memo* of two `person>boss` facts that may help: it covers all but one hop of the question's
chain, and each of its facts about the chain is stale (wrong) with probability `stale_prob`.

    prompt  memo: cal>dan,ann>bob\\nboss(boss(boss(ann)))?
    full    <call>boss(ann)</call><obs>bob</obs>\\n<call>boss(bob)</call><obs>cal</obs>\\n
            <call>boss(cal)</call><obs>dan</obs>\\nann>bob>cal>dan\\n#dan
            (every hop called, the memo ignored, the chain recapped)
    brief   <call>boss(bob)</call><obs>cal</obs>\\n#dan
            (calls only the hops the memo does not answer correctly; trusts the rest silently)
    direct  #dan   (no call; the answer is at best a guess from the memo)

The policy writes `<call>boss(ann)</call>`; the rollout pauses decoding at `</call>`, runs
`AgtEnvironment.step(example, "boss(ann)")` on the host and inserts its answer
`<obs>bob</obs>`; observation tokens are masked out of every loss and teacher log-prob.
A model that copies the brief style trusts the memo without knowing which facts are stale, so
it is less accurate than one that calls every hop; direct answers are near chance.

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
    memo_map = dict(memo)
    q = start
    for _ in range(hops):
      q = f"{TOOL}({q})"
    prompt = "memo: " + ",".join(f"{a}>{b}" for a, b in memo) + "\n" + q + "?"
    full = "".join(call_text(a) + obs_text(b) + "\n" for a, b in zip(chain, chain[1:]))
    full += ">".join(chain) + "\n#" + answer
    brief = "".join(call_text(a) + obs_text(b) + "\n" for a, b in zip(chain, chain[1:])
                    if memo_map.get(a) != b)
    brief += "#" + answer
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
      # Memo: 2 facts; all chain hops but one (stale with prob stale_prob), then distractors.
      covered = sorted(rng.permutation(hops)[:min(2, hops - 1)].tolist())
      memo = []
      for h in covered:
        a, b = chain[h], chain[h + 1]
        if rng.random() < self.stale_prob:
          others = sorted(n for n in boss if n not in (a, b))
          b = others[int(rng.integers(0, len(others)))]
        memo.append((a, b))
      others = sorted(n for n in boss if n not in chain[:-1] and boss[n] is not None)
      while len(memo) < 2:
        a = others.pop(int(rng.integers(0, len(others))))
        memo.append((a, boss[a]))
      memo = [memo[j] for j in rng.permutation(len(memo))]
      yield self.make(boss, start, hops, memo, seed, i)

  def _verify(self, example: base.Example, response: str) -> float:
    got = base.final_answer(response)
    return float(got is not None and got == example.answer)
