"""The mix of reasoning styles a trained policy writes, and how often each is right.

    python -m experiments.style_mix --config configs/toy.py --workdir DIR [--params sft/params]
        [--effort none] [--samples 256] [--temperature 1.0] [--out mix.json]

Loads the params under `DIR/<params>` (pi_SFT by default; `mopd/params` is the student) of a
run made with the same `--config` and overrides, samples `--samples` responses per domain on
the validation split at `--temperature` (the RL lanes' sampling temperature is 1) with the
prompt carrying `--effort` (`none`: the effort-free prompt every K3 teacher starts from), and
prints per domain and style the number of responses, their accuracy and mean length. A
toy response's first character names its style (`~` brief, `#` direct, anything else full;
mopd_jax/tasks/base.py). This is what tells whether SFT taught pi_SFT a style that RL at
max can select (docs/toy_results.md).
"""
import json
import sys

from absl import app, flags
from ml_collections import config_flags

from experiments import common

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory.")
_PARAMS = flags.DEFINE_string("params", "sft/params", "Params under the workdir.")
_EFFORT = flags.DEFINE_string("effort", "none", "The prompt's effort, or none.")
_SAMPLES = flags.DEFINE_integer("samples", 256, "Responses per domain.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_OUT = flags.DEFINE_string("out", "", "Write the table as JSON here.")

BATCH = 64  # rollouts per sampling call


def style_of(text: str) -> str:
  """The style a toy response is written in, from its first character."""
  return "brief" if text.startswith("~") else "direct" if text.startswith("#") else "full"


def measure(ctx, params, *, effort, samples: int, temperature: float) -> dict:
  """{domain: {style: {"n", "accuracy", "mean_length"}}} of `samples` responses per domain
  sampled from `params` on the validation split (`ctx`: a stages.context.Run)."""
  import jax  # pylint: disable=g-import-not-at-top
  from mopd_jax.tasks import base as task_base  # pylint: disable=g-import-not-at-top
  engine = ctx.engines.make(ctx.model_cfg, temperature)
  out = {}
  for domain in ctx.grid.domains:
    task, val = ctx.task(domain), ctx.data.split(domain, "validation")
    exs = [val[i % len(val)] for i in range(samples)]
    # The largest effort's budgets: no style is cut.
    budgets = task_base.effort_budgets(exs, ctx.grid.effort_names[-1], ctx.taus)
    stats = {}
    for lo in range(0, samples, BATCH):
      batch = exs[lo:lo + BATCH]
      res = engine.run(params, batch, [effort] * len(batch), budgets=budgets[lo:lo + BATCH],
                       rng=jax.random.PRNGKey(lo), environment=task.environment)
      right = task.verify_unless(batch, res.texts, res.over_budget, fill=0.0)
      for text, ok, traj in zip(res.texts, right, res.trajectories):
        s = stats.setdefault(style_of(text), [0, 0.0, 0])
        s[0], s[1], s[2] = s[0] + 1, s[1] + ok, s[2] + traj.num_tokens
    out[domain] = {style: {"n": n, "accuracy": right / n, "mean_length": length / n}
                   for style, (n, right, length) in sorted(stats.items())}
  return out


def format_table(mix: dict) -> str:
  lines = ["domain  style   n     accuracy  length", "------  ------  ----  --------  ------"]
  for domain, styles in mix.items():
    for style, s in styles.items():
      lines.append(f"{domain:6s}  {style:6s}  {s['n']:4d}  {s['accuracy']:8.3f}  "
                   f"{s['mean_length']:6.1f}")
  return "\n".join(lines)


def main(argv):
  ctx, params = common.run_and_params(argv, config=_CONFIG.value, workdir=_WORKDIR.value,
                                      params=_PARAMS.value)
  effort = None if _EFFORT.value == "none" else _EFFORT.value
  mix = measure(ctx, params, effort=effort, samples=_SAMPLES.value,
                temperature=_TEMPERATURE.value)
  print(format_table(mix))
  if _OUT.value:
    with open(_OUT.value, "w", encoding="utf-8") as f:
      json.dump({"params": _PARAMS.value, "effort": _EFFORT.value, "samples": _SAMPLES.value,
                 "temperature": _TEMPERATURE.value, "mix": mix}, f, indent=1)
  sys.stdout.flush()


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
