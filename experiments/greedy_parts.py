"""Where a student's greedy answers part from its teacher's in one (domain, effort) cell, and
how close each policy's own choice was there.

    python -m experiments.greedy_parts --config configs/toy.py --workdir DIR \
        [--cell cod/high] [--params mopd/params] [--examples 300] [--show 6] [--out parts.json]
        [--by token|char]

Decodes the cell's first `--examples` test prompts greedily with the student under
`DIR/<params>` (its prompt with the effort) and with the cell's teacher (its prompt as it
was trained), as the eval does, and for each prompt whose two responses differ finds the
first response token where they part. There it prints each policy's log-prob margin at
temperature 1 between its own choice and the other's (a margin near 0 is a near-tie that
greedy decoding resolves by a hair), the parting positions, and how many of the parted
prompts each policy answers right. A student whose per-token KL to its teacher is small can
still lose accuracy this way when the teacher's near-ties lean towards the right answer.

A teacher of another tokenizer (a character-level student only): its greedy response is
moved into the student's tokens (`alignment.retokenize_response`), the parting position is
a character, and the teacher's margin there is between the two characters under its
next-character distribution (`char_marginal.targets`, what the `char_kl` loss distils),
read after the student's prefix, which is the teacher's up to that character. A greedy
decoder of several-character tokens takes its argmax token, not its argmax character, so
the teacher's character margin there can be negative. A teacher response the student's
tokenizer cannot write is not compared (counted in `teacher_unwritable`). `--by=char` reads
a teacher of the student's tokenizer the same way and reports its token margin beside it
(`teacher_by_token`; the two are equal for a character-level student).
"""
import collections
import json

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_PARAMS = flags.DEFINE_string("params", "mopd/params", "The student's params under the workdir.")
_CELL = flags.DEFINE_string("cell", "cod/high", "The (domain/effort) cell.")
_EXAMPLES = flags.DEFINE_integer("examples", 300, "Test prompts of the cell.")
_SHOW = flags.DEFINE_integer("show", 6, "Parted prompts to print.")
_OUT = flags.DEFINE_string("out", "", "Write the figures as JSON here.")
_BY = flags.DEFINE_enum("by", "token", ["token", "char"],
                        "The teacher's margin by its tokens or by characters (a teacher of "
                        "another tokenizer: always characters).")


def first_part(a, b) -> int:
  """Index of the first token where the id lists `a` and `b` differ (None: equal)."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def _in_student_tokens(traj, *, toks: tuple) -> list:
  """A teacher's response ids moved into the student's tokens (`toks`: the teacher's
  tokenizer, the student's); None where the student's tokenizer cannot write it."""
  from mopd_jax.teachers import alignment  # pylint: disable=g-import-not-at-top
  try:
    return alignment.retokenize_response(*toks, traj.ids, gen_mask=traj.gen_mask)[0]
  except alignment.Unalignable:
    return None


def main(argv):
  import jax  # pylint: disable=g-import-not-at-top
  from mopd_jax.rollout import turns  # pylint: disable=g-import-not-at-top
  from mopd_jax.stages import wiring  # pylint: disable=g-import-not-at-top
  from mopd_jax.tasks import base as task_base  # pylint: disable=g-import-not-at-top
  ctx, student = common.run_and_params(argv, config=_CONFIG.value, workdir=_WORKDIR.value,
                                       params=_PARAMS.value)
  inp = wiring.eval_inputs(ctx)
  domain, _, effort = _CELL.value.partition("/")
  with open(ctx.path("teachers.json")) as f:
    entry = json.load(f)["teachers"].get(_CELL.value)
  if domain not in inp.tasks or entry is None:
    raise app.UsageError(f"--cell={_CELL.value!r} is not a cell of this run")
  family = inp.teachers.family_of(_CELL.value)
  by_char = family.cross or _BY.value == "char"
  tok, ttok = ctx.tok, family.tok
  if by_char:
    from mopd_jax.teachers import char_marginal  # pylint: disable=g-import-not-at-top
    try:
      char_marginal.table_for(tok, ttok)
    except char_marginal.NotCharacterLevel as e:
      raise app.UsageError(f"margins by characters need a character-level student: {e}")
  teacher = inp.teachers.load_one(entry, _CELL.value)
  teacher_cfg = family.model_cfg
  task, test = inp.tasks[domain], inp.data.split(domain, "test")
  exs = [test[i] for i in range(min(_EXAMPLES.value, len(test)))]
  budgets = task_base.effort_budgets(exs, effort, inp.grid.taus)
  policies = {"student": (inp.model_cfg, student, inp.view.of("student", effort)),
              "teacher": (teacher_cfg, teacher, inp.view.of("teacher", effort))}
  engines = {"student": inp.engines.make(inp.model_cfg, 0.0),  # as the eval samples each
             "teacher": inp.engines.teacher(teacher_cfg, 0.0, tok=ttok)}
  res, right = {}, {}
  for name, (cfg, params, shown) in policies.items():
    r = engines[name].run(params, exs, [shown] * len(exs), budgets=budgets,
                          rng=jax.random.PRNGKey(11), environment=task.environment)
    res[name] = r
    right[name] = task.verify_unless(exs, r.texts, np.asarray(r.over_budget), fill=0.0)
  ids = {"student": [t.ids for t in res["student"].trajectories],
         "teacher": [_in_student_tokens(t, toks=(ttok, tok)) if family.cross else t.ids
                     for t in res["teacher"].trajectories]}
  parted = []  # (prompt index, parting position, the student's token, the teacher's)
  for i in range(len(exs)):
    a, b = ids["student"][i], ids["teacher"][i]
    if b is None:  # counted in `teacher_unwritable`
      continue
    k = first_part(a, b)
    if k is not None and k < len(a) and k < len(b):
      parted.append((i, k, a[k], b[k]))
  out = {"cell": _CELL.value, "examples": len(exs),
         "accuracy": {p: float(np.mean(right[p])) for p in policies}, "parted": len(parted),
         # teacher responses the student's tokenizer cannot write: not compared
         "teacher_unwritable": sum(b is None for b in ids["teacher"]),
         "teacher_margin_by": "char" if by_char else "token"}
  if parted:
    margins = {}
    for name, (cfg, params, shown) in policies.items():
      own, other = (2, 3) if name == "student" else (3, 2)  # its token and the other's
      if name == "teacher" and by_char:  # after the student's prefix: the teacher's
        lp, ok, starts = common.char_logprobs(cfg, params,
                                       [res["student"].trajectories[i] for i, *_ in parted],
                                       [exs[i] for i, *_ in parted], toks=(tok, ttok),
                                       shown=shown, cell=_CELL.value)
        at = [(j, starts[j] + p[1]) for j, p in enumerate(parted)]
        if not all(ok[j, c] for j, c in at):
          raise RuntimeError("the teacher could not take a parted response's prefix")
        margins[name] = [float(lp[j, c, p[own]] - lp[j, c, p[other]])
                         for (j, c), p in zip(at, parted)]
      if name == "teacher" and family.cross:
        continue
      # By tokens (a teacher of the student's tokenizer read by characters: beside it).
      key = "teacher_by_token" if name == "teacher" and by_char else name
      rows = [turns.encode_prompt(tok, exs[i], shown) + list(res[name].trajectories[i].ids[:k])
              for i, k, *_ in parted]
      lp = common.next_logprobs(cfg, params, rows, pad_id=tok.pad_id)
      margins[key] = [float(lp[j, p[own]] - lp[j, p[other]]) for j, p in enumerate(parted)]
    q = lambda v: [float(x) for x in np.quantile(v, [0.1, 0.5, 0.9])]
    out.update({
        "positions": dict(collections.Counter(int(k) for _, k, *_ in parted)),
        "margin_quantiles": {p: q(v) for p, v in margins.items()},
        "right_among_parted": {p: int(sum(right[p][i] for i, *_ in parted)) for p in policies}})
  print(json.dumps(out, indent=1))
  for i, k, *_ in parted[:_SHOW.value]:
    print(f"{exs[i].prompt!r} parts at token {k}: student {res['student'].texts[i]!r} "
          f"({right['student'][i]:.0f}), teacher {res['teacher'].texts[i]!r} "
          f"({right['teacher'][i]:.0f})")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
