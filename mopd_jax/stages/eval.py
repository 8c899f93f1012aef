"""The eval stage: pi_SFT and the student in every (domain, effort) cell of the grid, and
each teacher in its own cell, on the test split (greedy at `eval.temperature` 0)."""
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
  n = ctx.config.eval.num_examples
  bar = Progress("eval", len(ctx.grid.cells))  # one step = one (domain, effort) cell
  for domain in ctx.grid.domains:
    task = ctx.task(domain)
    test = ctx.split(domain, "test")
    exs = [test[i] for i in range(min(n, len(test)))]
    for effort in ctx.grid.effort_names:
      budgets = ctx.budgets(exs, effort)
      for policy in ("sft", "student"):
        if policy in policies:
          m = sft.evaluate(ctx.eval_engine, policies[policy], task, exs, effort, budgets,
                           jax.random.PRNGKey(11))
          cells.append({"policy": policy, "domain": domain, "effort": effort, **m})
      t = manifest["teachers"].get(f"{domain}/{effort}")
      if t is not None:
        m = sft.evaluate(ctx.teacher_engine(), ctx.load_teacher(t), task, exs, effort,
                         budgets, jax.random.PRNGKey(11))
        cells.append({"policy": "teacher", "domain": domain, "effort": effort, **m})
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
  lines = ["policy   domain effort  accuracy  length  over-budget   n",
           "-------  ------ ------  --------  ------  -----------  ---"]
  for c in cells:
    lines.append(f"{c['policy']:7s}  {c['domain']:6s} {c['effort']:6s}  {c['accuracy']:8.3f}  "
                 f"{c['mean_length']:6.1f}  {c['over_budget_rate']:11.3f}  {c['n']:3d}")
  return "\n".join(lines)
