"""Entry point: `python -m experiments.run --config configs/toy.py --workdir DIR`.

Thin on purpose: parse the locked config, log the devices, hand over to the library.
Notebooks and tests call `mopd_jax.pipeline.run` directly.

Errors: a bad flag (an unknown field, a value of the wrong type, a config file that does not
load), a bad config value (mopd_jax/config/schema.py checks every field before any stage starts)
or a missing `--workdir` prints one `config error:` line naming the field, the value and
what is allowed, and exits with status 2; `--verbosity=1` adds the traceback. A preempted run exits with
`checkpoint.PREEMPTED_EXIT_CODE`; the same command resumes it. A teacher server
(`teacher.endpoints`) down past its retries prints one `teacher error:` line naming the cell
and URL and exits with status 3; the same command resumes once the server is back.
"""
import logging as pylogging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from mopd_jax import configure
from mopd_jax.runtime import allocator

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and reports.")
TEACHER_EXIT_CODE = 3  # a teacher server stayed down: the last finished step is checkpointed


class _QuietOrbax(pylogging.Filter):
  """Drops orbax's per-save INFO lines (a dozen per checkpoint) so the progress bars stay
  readable; its warnings and errors still show."""

  def filter(self, record):
    return record.levelno >= pylogging.WARNING or "orbax" not in record.pathname


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_QuietOrbax())
  try:
    config = _CONFIG.value
    config.to_dict()  # a config file that is missing or failed to load raises here
  except (OSError, ValueError, TypeError, AttributeError, KeyError) as e:
    if logging.get_verbosity() >= 1:
      raise
    print(f"config error: {_flag_error(e)}", file=sys.stderr, flush=True)
    sys.exit(2)
  import jax

  from mopd_jax import pipeline
  from mopd_jax.config import schema as config_mod
  from mopd_jax.io import checkpoint
  from mopd_jax.runtime import distributed
  from mopd_jax.teachers import client as teacher_client
  try:
    # The RunConfig, built once here and handed down: every check but the device count.
    # Multi-host: start jax.distributed (its typed `distributed` block or JAX_* environment
    # variables) before the first device query initialises a backend, then check the mesh.
    run_config = configure.build(config, None)
    try:
      distributed.initialize(run_config.distributed)
    except ValueError as e:
      raise config_mod.ConfigError(str(e)) from e
    config_mod.check_devices(run_config, jax.device_count())
    logging.info("JAX %s on %d %s device(s), process %d of %d", jax.__version__,
                 jax.device_count(), jax.default_backend(), jax.process_index(),
                 jax.process_count())
    if distributed.is_main():
      print(f"[run] {allocator.describe()}", flush=True)
    pipeline.run(run_config, _WORKDIR.value)
  except config_mod.ConfigError as e:  # a bad config value or flag: one line, exit status 2
    if logging.get_verbosity() >= 1:
      raise
    print(f"config error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  except teacher_client.TeacherUnavailable as e:  # a teacher server down past its retries
    print(f"teacher error: {e}", file=sys.stderr, flush=True)
    sys.exit(TEACHER_EXIT_CODE)
  except checkpoint.Preempted as e:
    # Non-zero so a scheduler knows the run is unfinished; re-running resumes.
    logging.error("preempted: %s", e)
    print(f"PREEMPTED: {e}", file=sys.stderr, flush=True)
    sys.exit(checkpoint.PREEMPTED_EXIT_CODE)


def _flag_error(e: BaseException) -> str:
  """One line from a flag or config-file error: nested causes unwrapped, a config file's
  embedded traceback reduced to its last line."""
  while len(e.args) == 1 and isinstance(e.args[0], BaseException):
    e = e.args[0]
  msg = str(e.args[0]) if len(e.args) == 1 else str(e)
  if "Traceback (most recent call last)" in msg:
    head = msg.split("Traceback (most recent call last)")[0].rstrip(": \n")
    last = [line.strip() for line in msg.splitlines() if line.strip()][-1]
    msg = f"{head}: {last}"
  return f"{type(e).__name__}: {' '.join(msg.split())}"


def _parse_flags(argv):
  """absl's flag parsing, with a bad flag (an unknown config field, a value of the wrong
  type, an unknown config variant) printed as one `config error:` line and exit status 2;
  `--verbosity=1` shows the traceback instead."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError) as e:
    if any(a in ("--verbosity=1", "-v=1") for a in argv):
      raise
    print(f"config error: {_flag_error(e)}", file=sys.stderr, flush=True)
    sys.exit(2)


if __name__ == "__main__":
  try:  # first: the host allocator can only be chosen by starting the process again
    allocator.reexec("experiments.run", sys.argv)
  except ValueError as e:
    print(f"config error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  flags.mark_flags_as_required(["config"])
  app.run(main, flags_parser=_parse_flags)
