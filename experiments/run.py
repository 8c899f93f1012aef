"""Entry point: `python -m experiments.run --config configs/toy.py --workdir DIR`.

Thin on purpose: parse the locked config, log the devices, hand over to the library.
Notebooks and tests call `mopd_jax.pipeline.run` directly.
"""
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and reports.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax

  from mopd_jax import pipeline

  logging.info("JAX %s on %d %s device(s), process %d of %d", jax.__version__,
               jax.device_count(), jax.default_backend(), jax.process_index(),
               jax.process_count())
  pipeline.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  flags.mark_flags_as_required(["config"])
  app.run(main)
