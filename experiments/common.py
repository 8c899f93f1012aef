"""What the measurement scripts share: a finished run's context and one of its policies."""
from absl import app


def run_and_params(argv, *, config, workdir: str, params: str):
  """(stages.context.Run, params) of the run in `workdir` made with `config` (the locked
  ConfigDict with its overrides) and the policy saved under `workdir/<params>` (e.g.
  `sft/params`); UsageError for stray arguments or a missing workdir."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not workdir:
    raise app.UsageError("--workdir is required")
  import jax  # pylint: disable=g-import-not-at-top  (after absl's flags are parsed)
  from mopd_jax import configure  # pylint: disable=g-import-not-at-top
  from mopd_jax.io import checkpoint  # pylint: disable=g-import-not-at-top
  from mopd_jax.stages.context import Run  # pylint: disable=g-import-not-at-top
  ctx = Run(configure.build(config, jax.device_count()), workdir)
  return ctx, checkpoint.load_params(ctx.path(*params.split("/")), ctx.policies.like())
