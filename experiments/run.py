"""Entry point: `python -m experiments.run --config configs/toy.py --workdir DIR`.

Thin on purpose: parse the locked config, log the devices, hand over to the library.
Notebooks and tests call `mopd_jax.pipeline.run` directly.

Errors: a bad config value (mopd_jax/config.py checks every field before any stage starts)
or a missing `--workdir` prints one line naming the field, the value and what is allowed,
and exits with status 2; `--verbosity=1` adds the traceback. A preempted run exits with
`checkpoint.PREEMPTED_EXIT_CODE`; the same command resumes it.
"""
import logging as pylogging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and reports.")


class _QuietOrbax(pylogging.Filter):
  """Drops orbax's per-save INFO lines (a dozen per checkpoint) so the progress bars stay
  readable; its warnings and errors still show."""

  def filter(self, record):
    return record.levelno >= pylogging.WARNING or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietOrbax())
  import jax

  from mopd_jax import checkpoint, config as config_mod, distributed, pipeline
  try:
    # Multi-host: start jax.distributed (config.distributed or JAX_* environment variables)
    # before the first device query below initialises a backend.
    try:
      distributed.initialize(_CONFIG.value.distributed)
    except ValueError as e:
      raise config_mod.ConfigError(str(e)) from e
    logging.info("JAX %s on %d %s device(s), process %d of %d", jax.__version__,
                 jax.device_count(), jax.default_backend(), jax.process_index(),
                 jax.process_count())
    pipeline.run(_CONFIG.value, _WORKDIR.value)
  except config_mod.ConfigError as e:  # a bad config value or flag: one line, exit status 2
    if logging.get_verbosity() >= 1:
      raise
    print(f"config error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  except checkpoint.Preempted as e:
    # Non-zero so a scheduler knows the run is unfinished; re-running resumes.
    logging.error("preempted: %s", e)
    print(f"PREEMPTED: {e}", file=sys.stderr, flush=True)
    sys.exit(checkpoint.PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
