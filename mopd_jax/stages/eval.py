"""The eval stage: pi_SFT and the student in every (domain, effort) cell of the grid, and
each teacher in its own cell, on the test split (greedy at `eval.temperature` 0): accuracy,
mean and 90th-percentile length, over-budget rate; with `eval.samples` k > 0 also
`sample_accuracy`, the mean accuracy of k responses sampled at `eval.sample_temperature`;
with `eval.teacher_logratio` also pi_SFT's and the student's `teacher_logratio`, the mean
per-token log pi - log pi_T along their greedy answers to the cell's teacher
(`mopd_jax/evaluation/agreement.py`), scored as the MOPD stage scores (the
`teacher.endpoints` servers' client or the bank in process). The stage takes its `Inputs`
(built by `stages/wiring.py`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

import jax
import numpy as np

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.evaluation import agreement
from mopd_jax.io import checkpoint, storage
from mopd_jax.stages import loops, sources
from mopd_jax.tasks import base as task_base, grid as grid_mod, views
from mopd_jax.training import mopd, sft


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the eval stage reads and works with. `data.split(domain, "test")`: the domain's
  test split; `engines.make(model_cfg, temperature)`: the rollout engine of a model at a
  temperature; `policies.load(path)`: a policy of the student's shape;
  `teachers.load_one(entry)`: a teacher of the manifest; `scorer`: the teachers' scorer of
  stratified batches, cells in the order of `teacher_cells` (None unless
  `eval.teacher_logratio`)."""
  cfg: config_mod.EvalConfig
  grid: grid_mod.Grid
  view: views.PromptView
  model_cfg: models.ModelConfig
  tasks: Mapping[str, task_base.Task]
  data: sources.DataSource
  engines: sources.Engines
  policies: sources.Policies
  teachers: sources.TeacherSource
  files: loops.Workdir
  loops: loops.Loops
  scorer: Optional[Callable] = None
  teacher_cells: tuple = ()
  # `eval.kl_rollouts`: the student's rollout setup (its sampler, the bank's router, the
  # tasks, the view) and the bank at its scoring temperature; None when not measured.
  kl_setup: Optional[mopd.StepSetup] = None
  kl_scoring: Any = None


def run(inp: Inputs) -> None:
  files = inp.files
  policies = {"sft": inp.policies.load(files.path("sft", "params"))}
  if storage.exists(files.path("mopd", "params")):
    policies["student"] = inp.policies.load(files.path("mopd", "params"))
  manifest = checkpoint.read_json(files.path("teachers.json"), default={"teachers": {}})
  cells = []
  ec = inp.cfg
  n = ec.num_examples
  bar = loops.Progress("eval", len(inp.grid.cells))  # one step = one (domain, effort) cell
  for domain in inp.grid.domains:
    task = inp.tasks[domain]
    test = inp.data.split(domain, "test")
    exs = [test[i] for i in range(min(n, len(test)))]
    for effort in inp.grid.effort_names:
      budgets = task_base.effort_budgets(exs, effort, inp.grid.taus)
      runs = [(p, inp.model_cfg, policies[p]) for p in ("sft", "student") if p in policies]
      name = f"{domain}/{effort}"
      t = manifest["teachers"].get(name)
      if t is not None:  # each teacher with its family's model and tokenizer
        runs.append(("teacher", inp.teachers.cell_model_cfg(name),
                     inp.teachers.load_one(t, name, placed=True)))
      for policy, model_cfg, params in runs:
        # pi_SFT and the student see the effort; a teacher sees its prompts as it was trained,
        # in its own tokens.
        shown = inp.view.of(policy, effort)
        logratio = _LogRatio(inp, domain, effort) if policy != "teacher" else None
        engine_of = (functools.partial(inp.engines.teacher,
                                       tok=inp.teachers.family_of(name).tok)
                     if policy == "teacher" else inp.engines.make)
        # A teacher of another tokenizer: its engine counts lengths and budgets in the
        # student's tokens (`Engines.make`).
        m = sft.evaluate(engine_of(model_cfg, ec.temperature), params, task,
                         examples=exs, effort=shown, budgets=budgets,
                         rng=jax.random.PRNGKey(11),
                         hooks=sft.EvalHooks(
                             logratio and logratio.scorer_of(model_cfg, params)))
        m.update(logratio.metrics() if logratio else {})
        if ec.samples:
          engine = engine_of(model_cfg, ec.sample_temperature)
          m["sample_accuracy"] = sum(
              sft.evaluate(engine, params, task, examples=exs, effort=shown,
                           budgets=budgets, rng=jax.random.PRNGKey(1000 + k))["accuracy"]
              for k in range(ec.samples)) / ec.samples
        cells.append({"policy": policy, "domain": domain, "effort": effort, **m})
      bar.update(cells[-1], keys=("accuracy", "mean_length"))
  bar.close()
  log = inp.loops.logger("eval")  # final cells as scalars: "<policy>/<domain>/<effort>/accuracy"
  for c in cells:
    log.scalars(0, {k: c[k] for k in ("accuracy", "mean_length", "over_budget_rate")},
                prefix=f"{c['policy']}/{c['domain']}/{c['effort']}/")
  log.close()
  out = {"cells": cells}
  if inp.kl_setup is not None and ec.kl_rollouts:
    init = files.path("mopd", loops.INIT_PARAMS)
    if "student" in policies and storage.exists(init):  # the teacher-SFT init's student
      policies = {"sft": policies["sft"], "init": inp.policies.load(init),
                  "student": policies["student"]}
    out["kl_heldout"] = heldout_kl(inp, policies)
  checkpoint.write_json(files.path("eval.json"), out)
  files.mark_done("eval", {"num_cells": len(cells)})
  print(cells_table(cells))


def heldout_kl(inp: Inputs, policies: dict) -> dict:
  """{policy: `agreement.heldout_kl`} of pi_SFT, the initialised student (the teacher-SFT
  init's, `init`, when the run has one) and the final student on the first
  `eval.kl_rollouts` test prompts of each domain at every effort (the same prompts and
  rollout keys for both)."""
  n = inp.cfg.kl_rollouts
  examples = {}
  for d in inp.grid.domains:
    test = inp.data.split(d, "test")
    examples[d] = [test[i] for i in range(min(n, len(test)))]
  out = {}
  for policy, params in policies.items():
    out[policy] = agreement.heldout_kl(inp.model_cfg, params, inp.kl_setup,
                                       scoring=inp.kl_scoring, examples=examples,
                                       rng=jax.random.PRNGKey(agreement.HELDOUT_KEY))
    print(f"[eval] {policy}: {agreement.MEASURES[out[policy]['measure']]} to the routed "
          f"teachers on its own rollouts of {out[policy]['rollouts']} test prompts: "
          f"{out[policy]['kl_exact']:.4f} +- {out[policy]['kl_exact_se']:.4f}")
  return out


class _LogRatio:
  """Collects a policy's per-row log-ratio to the cell's teacher (`agreement.row_logratios`)
  along the rollouts `sft.evaluate` hands it; nothing without a scorer."""

  def __init__(self, inp: Inputs, domain: str, effort: str):
    self.inp, self.rows = inp, []
    self.scoring = None if inp.scorer is None else agreement.Scoring(
        inp.scorer, inp.teacher_cells.index(f"{domain}/{effort}"), len(inp.teacher_cells),
        inp.view.teacher(effort), rows=sft.EVAL_BATCH)

  def scorer_of(self, model_cfg: models.ModelConfig, params):
    """`sft.evaluate`'s `on_rollouts` for the policy (model_cfg, params), or None."""
    if self.scoring is None:
      return None
    tok = self.inp.engines.make(model_cfg, self.inp.cfg.temperature).tok
    return lambda examples, res: self.rows.extend(agreement.row_logratios(
        model_cfg, params, tok, trajs=res.trajectories, examples=examples, scoring=self.scoring))

  def metrics(self) -> dict:
    if not self.rows:
      return {}
    r = np.asarray(self.rows)
    return {"teacher_logratio": float(r.mean()),
            "teacher_logratio_se": float(r.std() / np.sqrt(len(r)))}


def cells_table(cells) -> str:
  lines = ["policy   domain effort  accuracy  length  p90 len  over-budget   n",
           "-------  ------ ------  --------  ------  -------  -----------  ---"]
  for c in cells:
    lines.append(f"{c['policy']:7s}  {c['domain']:6s} {c['effort']:6s}  {c['accuracy']:8.3f}  "
                 f"{c['mean_length']:6.1f}  {c['p90_length']:7.1f}  "
                 f"{c['over_budget_rate']:11.3f}  {c['n']:3d}")
  return "\n".join(lines)
