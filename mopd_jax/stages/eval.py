"""The eval stage: pi_SFT and the student in every (domain, effort) cell of the grid, and
each teacher in its own cell, on the test split (greedy at `eval.temperature` 0): accuracy,
mean and 90th-percentile length, over-budget rate; with `eval.samples` k > 0 also
`sample_accuracy`, the mean accuracy of k responses sampled at `eval.sample_temperature`."""
from __future__ import annotations


import jax

from mopd_jax import checkpoint, sft, storage
from mopd_jax.stages.context import Progress, Run


def run(ctx: Run) -> None:
  like = ctx.params_like()
  policies = {"sft": checkpoint.load_params(ctx.path("sft", "params"), like)}
  if storage.exists(ctx.path("mopd", "params")):
    policies["student"] = checkpoint.load_params(ctx.path("mopd", "params"), like)
  manifest = checkpoint.read_json(ctx.path("teachers.json"), default={"teachers": {}})
  cells = []
  ec = ctx.config.eval
  n = ec.num_examples
  bar = Progress("eval", len(ctx.grid.cells))  # one step = one (domain, effort) cell
  for domain in ctx.grid.domains:
    task = ctx.task(domain)
    test = ctx.split(domain, "test")
    exs = [test[i] for i in range(min(n, len(test)))]
    for effort in ctx.grid.effort_names:
      budgets = ctx.budgets(exs, effort)
      runs = [(p, ctx.model_cfg, policies[p]) for p in ("sft", "student") if p in policies]
      t = manifest["teachers"].get(f"{domain}/{effort}")
      if t is not None:
        runs.append(("teacher", ctx.teacher_cfg, ctx.load_teacher(t)))
      for policy, model_cfg, params in runs:
        # pi_SFT and the student see the effort; a teacher sees its prompts as it was trained.
        shown = ctx.view.of(policy, effort)
        m = sft.evaluate(ctx.make_engine(model_cfg, ec.temperature), params, task,
                         examples=exs, effort=shown, budgets=budgets,
                         rng=jax.random.PRNGKey(11))
        if ec.samples:
          engine = ctx.make_engine(model_cfg, ec.sample_temperature)
          m["sample_accuracy"] = sum(
              sft.evaluate(engine, params, task, examples=exs, effort=shown,
                           budgets=budgets, rng=jax.random.PRNGKey(1000 + k))["accuracy"]
              for k in range(ec.samples)) / ec.samples
        cells.append({"policy": policy, "domain": domain, "effort": effort, **m})
      bar.update(cells[-1], keys=("accuracy", "mean_length"))
  bar.close()
  log = ctx.logger("eval")  # final cells as scalars: "<policy>/<domain>/<effort>/accuracy"
  for c in cells:
    log.scalars(0, {k: c[k] for k in ("accuracy", "mean_length", "over_budget_rate")},
                prefix=f"{c['policy']}/{c['domain']}/{c['effort']}/")
  log.close()
  checkpoint.write_json(ctx.path("eval.json"), {"cells": cells})
  ctx.mark_done("eval", {"num_cells": len(cells)})
  print(cells_table(cells))


def cells_table(cells) -> str:
  lines = ["policy   domain effort  accuracy  length  p90 len  over-budget   n",
           "-------  ------ ------  --------  ------  -------  -----------  ---"]
  for c in cells:
    lines.append(f"{c['policy']:7s}  {c['domain']:6s} {c['effort']:6s}  {c['accuracy']:8.3f}  "
                 f"{c['mean_length']:6.1f}  {c['p90_length']:7.1f}  "
                 f"{c['over_budget_rate']:11.3f}  {c['n']:3d}")
  return "\n".join(lines)
