"""Whether a policy copies `gen`'s memo or adds the first half's terms in the head: the first
value of the brief style, policy by policy.

    python -m experiments.memo_probe --config configs/toy.py --workdir DIR [--effort high] \
        [--params sft/params,mopd/init_params,mopd/params] [--examples 300] [--out probe.json]

`gen`'s brief answer starts `~v` with v the sum of the first half of the terms (mod m); the
prompt's memo `s4=` claims it and is stale (wrong) on a share of the prompts
(`tasks/gen.py`). After each of the cell's first `--examples` test prompts and a forced `~`,
this reads each policy's next-character distribution over the m values (`char_marginal`: a
token may hold `~`, a value and what follows, e.g. a BPE's `2,`): the policies saved under
the workdir (`--params`, seeing the effort as the student does) and the cell's teacher (its
prompt as it was trained, in its own tokens). It prints, for the prompts whose memo is stale and for the rest,
each policy's mean probability of the memo's value ("claimed"), of the true half-sum and of
the other values, and on the stale prompts how often its most likely value is the true one
(`common.claim_split`). A policy
that copies puts its mass on the memo on both; one that adds in the head puts it on the true
value, which differs from the memo only where the memo is stale; one that cannot add but
knows the memo may be stale spreads the stale prompts' mass evenly over the other values.
"""
import json

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from experiments import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_PARAMS = flags.DEFINE_list("params", ["sft/params", "mopd/init_params", "mopd/params"],
                            "The policies under the workdir (absent ones are skipped).")
_DOMAIN = flags.DEFINE_string("domain", "gen", "A domain of the `gen` task.")
_EFFORT = flags.DEFINE_string("effort", "high", "The effort (the cell's teacher is read).")
_EXAMPLES = flags.DEFINE_integer("examples", 300, "Test prompts of the cell.")
_OUT = flags.DEFINE_string("out", "", "Write the figures as JSON here.")


def _char_tokenizer(tok):
  """`tok` where it writes one token per character, else the toy's character tokenizer with
  its efforts: the side every policy is read from by characters."""
  from mopd_jax.io.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top
  from mopd_jax.teachers import char_marginal  # pylint: disable=g-import-not-at-top
  try:
    char_marginal.table_for(tok, tok)
    return tok
  except char_marginal.NotCharacterLevel:
    return CharTokenizer(efforts=tok.efforts)


def main(argv):
  from mopd_jax.io import checkpoint, storage  # pylint: disable=g-import-not-at-top
  from mopd_jax.rollout import turns  # pylint: disable=g-import-not-at-top
  ctx = common.run_of(argv, config=_CONFIG.value, workdir=_WORKDIR.value)
  domain, effort = _DOMAIN.value, _EFFORT.value
  cell = f"{domain}/{effort}"
  if domain not in ctx.grid.domains or "memo" not in ctx.data.split(domain, "test")[0].meta:
    raise app.UsageError(f"--domain={domain!r} is not a domain of the gen task in this run")
  if effort not in ctx.grid.effort_names:
    raise app.UsageError(f"--effort={effort!r} is not an effort of this run")
  test = ctx.data.split(domain, "test")
  exs = [test[i] for i in range(min(_EXAMPLES.value, len(test)))]
  m = int(ctx.task(domain).modulus)
  ctok = _char_tokenizer(ctx.tok)
  tilde, values = ctok.encode("~"), [ctok.encode(str(v))[0] for v in range(m)]
  true = [e.meta["values"][len(e.meta["terms"]) // 2 - 1] for e in exs]  # the first half's sum
  memo = [e.meta["memo"] for e in exs]

  def split(model_cfg, params, ptok, shown):
    """The policy's next-character probabilities of the m values after its prompt and `~`."""
    trajs = [turns.Trajectory(turns.encode_prompt(ctok, ex, shown), tilde + values[:1],
                              [1, 1], [0.0, 0.0]) for ex in exs]
    lp, ok, starts = common.char_logprobs(model_cfg, params, trajs, exs, toks=(ctok, ptok),
                                          shown=shown, cell=cell)
    at = (np.arange(len(exs)), starts + 1)
    if not ok[at].all():
      raise RuntimeError("a policy's tokenizer could not take a prompt and `~`")
    return common.claim_split(np.exp(lp[at][:, values]), claimed=memo, true=true)

  out = {"cell": cell, "examples": len(exs), "policies": {}}
  for path in _PARAMS.value:
    full = ctx.path(*path.split("/"))
    if not storage.exists(full):
      print(f"[memo_probe] {path}: not in the run, skipped")
      continue
    out["policies"][path] = split(ctx.model_cfg, checkpoint.load_params(full, ctx.policies.like()),
                                  ctx.tok, ctx.view.of("student", effort))
  entry = storage.read_json(ctx.path("teachers.json"), {}).get("teachers", {}).get(cell)
  if entry is not None:
    family = ctx.teachers.family_of(cell)
    out["policies"]["teacher"] = split(family.model_cfg, ctx.teachers.load_one(entry, cell),
                                       family.tok, ctx.view.of("teacher", effort))
  print(json.dumps(out, indent=1))
  print("policy | stale prompts: p(memo) / p(true) / p(other), argmax true | "
        "fresh prompts: p(memo = true) / p(other)")
  for name, s in out["policies"].items():
    st, fr = s.get("stale"), s.get("fresh")
    print(f"{name} | " + (f"{st['claimed']:.3f} / {st['true']:.3f} / {st['other']:.3f}, "
                          f"{st['argmax']['true']:.2f}" if st else "-") + " | " +
          (f"{fr['claimed']:.3f} / {fr['other']:.3f}" if fr else "-"))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
