"""The run config checked in one place, before anything compiles.

A run config is the ConfigDict of `configs/base.py` with a file's overrides (toy.py,
qwen3_mopd.py) and the command line's. `validate(config, num_devices)` raises ValueError
naming the field, its value and what is allowed for: every numeric field (type, finiteness,
sign or range), every enum, the task grid (unknown domain or effort names list the known
ones), and the cross-field rules (batch sizes over the mesh, losses that need one another).
It uses `raise`, never `assert`, so `python -O` keeps the checks, and raises `ConfigError`
(a ValueError) so that the command line can tell a bad value from a failure inside a stage.
"""
from __future__ import annotations

import hashlib
import math

import ml_collections

from mopd_jax import grid as grid_mod
from mopd_jax import lanes, models, mopd, placement, rl, sft
from mopd_jax.tasks import base as task_base


class ConfigError(ValueError):
  """A config value or command-line flag that is not allowed; the message names the field,
  the value and what is allowed."""


def run_grid(config: ml_collections.ConfigDict) -> grid_mod.Grid:
  """The run's domains x efforts (`config.domains`, `config.efforts`; see mopd_jax.grid)."""
  return grid_mod.from_config(config, task_base.registered())


def known_domains(config: ml_collections.ConfigDict) -> set:
  """Every domain a config can name: its `tasks` blocks and the registered tasks."""
  return set(dict(config.tasks or {})) | set(task_base.registered())


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> models.ModelConfig:
  """The student's ModelConfig: a preset with overrides, or a Hugging Face checkpoint's."""
  from mopd_jax import hf  # pylint: disable=g-import-not-at-top  (safetensors on demand)
  return hf.resolve_model_config(config.model, vocab_size)


def config_hash(config: ml_collections.ConfigDict) -> str:
  return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


def outside_teacher(config: ml_collections.ConfigDict) -> tuple:
  """(cell, seed) of the outside-teacher ablation (`teacher.outside_cell`, e.g. "gen/max":
  that cell's teacher is trained from a second SFT of seed `teacher.outside_seed`), or
  (None, None) when the ablation is off."""
  t = config.teacher
  cell = t.outside_cell
  if not cell:
    return None, None
  names = run_grid(config).names
  if cell not in names:
    raise ValueError(f"teacher.outside_cell={cell!r} is not a teacher cell; expected one of "
                     f"{names}")
  if t.hf_paths:
    raise ValueError("teacher.outside_cell needs teachers trained by the rl stage; it cannot "
                     "be combined with teacher.hf_paths")
  seed = t.outside_seed
  if not isinstance(seed, int) or seed == config.seed:
    raise ValueError(f"teacher.outside_seed={seed!r} must be an int other than the run's "
                     f"seed {config.seed} (the outside SFT needs its own init and order)")
  return cell, int(seed)


def sft_schedule(config: ml_collections.ConfigDict, grid: grid_mod.Grid) -> list:
  return sft.schedule(config.sft.schedule, grid.domains, known_domains(config))


def sft_style_weights(config: ml_collections.ConfigDict, grid: grid_mod.Grid) -> dict:
  return sft.domain_style_weights(config.sft.style_weights, grid.domains,
                                  known_domains(config))


# --- field checks ----------------------------------------------------------------------------
def _int(name: str, v, lo: int = 1) -> None:
  if isinstance(v, bool) or not isinstance(v, int) or v < lo:
    raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _num(name: str, v, lo: float = 0.0, *, strict: bool = False):
  ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and
        (v > lo if strict else v >= lo))
  if not ok:
    raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {lo}, got {v!r}")


def _enum(name: str, v, allowed) -> None:
  if v not in allowed:
    raise ValueError(f"{name}={v!r}; expected one of {tuple(allowed)}")


def validate(config: ml_collections.ConfigDict, num_devices: int) -> grid_mod.Grid:
  """Every check of the module docstring; returns the run's grid. Raises ConfigError."""
  try:
    return _validate(config, num_devices)
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(str(e)) from e


def _validate(config: ml_collections.ConfigDict, num_devices: int) -> grid_mod.Grid:
  c = config
  _int("seed", c.seed, 0)
  _int("log_every", c.log_every)
  _int("checkpoint.every", c.checkpoint.every)
  mesh = dict(c.mesh)
  for axis, size in mesh.items():
    _int(f"mesh.{axis}", size)
  prod = placement.num_devices(c)  # + the teachers' sub-mesh when disaggregated
  if prod != num_devices:
    raise ValueError(f"mesh {mesh} (with the teacher placement {c.get('placement')}) "
                     f"has {prod} devices but {num_devices} are available")
  grid = run_grid(c)  # raises on unknown domains or efforts, naming the known ones
  sizes = tuple(c.data.sizes)
  if len(sizes) != 3 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                            for s in sizes):
    raise ValueError(f"data.sizes must be three ints >= 1 (train, validation, test), got "
                     f"{sizes!r}")
  # sft
  for name in ("steps", "batch_size", "microbatches"):
    _int(f"sft.{name}", c.sft[name])
  _int("sft.warmup_steps", c.sft.warmup_steps, 0)
  _num("sft.lr", c.sft.lr, strict=True)
  _num("sft.weight_decay", c.sft.weight_decay)
  _enum("sft.effort_mode", c.sft.effort_mode, ("random", "style"))
  sft_schedule(c, grid)
  sft_style_weights(c, grid)
  # rl
  _enum("rl.loss", c.rl.loss, ("pmd", "grpo"))
  for name in ("steps_per_effort", "prompts_per_step", "group_size", "microbatches",
               "lane_processes"):
    _int(f"rl.{name}", c.rl[name])
  for name in ("anneal_steps", "plateau_window"):
    _int(f"rl.{name}", c.rl[name], 0)
  _num("rl.temperature", c.rl.temperature)
  for name in ("lr", "tau_kl"):
    _num(f"rl.{name}", c.rl[name], strict=True)
  for name in ("anneal_lr", "anneal_tau_kl", "plateau_delta", "token_clip"):
    _num(f"rl.{name}", c.rl[name])
  refs = rl.references(c.rl.reference, grid.anneal_order)  # raises on a bad spec
  if set(refs.values()) != {"sampler"} and c.rl.loss != "pmd":
    raise ValueError(f"rl.reference={c.rl.reference!r} holds PMD's old policy "
                     f"fixed for an effort phase; it needs rl.loss='pmd', got {c.rl.loss!r}")
  lanes.process_count(c.rl, 1)  # raises on a bad rl.lane_processes
  # mopd
  _enum("mopd.loss", c.mopd.loss, ("mopd", "pg", "topk"))
  _enum("mopd.init", c.mopd.init, ("sft", "teacher_sft"))
  for name in ("steps", "prompts_per_cell", "microbatches", "init_samples_per_cell",
               "init_sft_steps", "top_k"):
    _int(f"mopd.{name}", c.mopd[name])
  _int("mopd.warmup_steps", c.mopd.warmup_steps, 0)
  _num("mopd.lr", c.mopd.lr, strict=True)
  _num("mopd.r_max", c.mopd.r_max, strict=True)
  _num("mopd.teacher_temperature", c.mopd.teacher_temperature, strict=True)
  _num("mopd.alpha", c.mopd.alpha)
  _enum("mopd.staleness", c.mopd.staleness, (0, 1))
  bounds = tuple(c.mopd.is_bounds)
  if c.mopd.staleness and not (len(bounds) == 2 and all(math.isfinite(b) for b in bounds) and
                               0 <= bounds[0] <= 1 <= bounds[1]):
    raise ValueError(f"mopd.is_bounds must be (low, high) with 0 <= low <= 1 <= high, got "
                     f"{bounds}")
  if c.mopd.staleness and c.mopd.loss != "mopd":
    raise ValueError(f"mopd.staleness=1 weights the eq. 15 loss by truncated importance "
                     f"weights; it needs mopd.loss='mopd', got {c.mopd.loss!r}")
  mopd.prompt_mode(c.mopd.prompts_across_efforts, c.mopd.effort_mix, grid.effort_names)
  # rollout, eval, smoke
  for name in ("max_response_tokens", "max_turns", "width"):
    _int(f"rollout.{name}", c.rollout[name], 0 if name == "max_turns" else 1)
  _int("eval.num_examples", c.eval.num_examples)
  _num("eval.temperature", c.eval.temperature)
  _int("smoke.max_new_tokens", c.smoke.max_new_tokens)
  # Every batch splits over the data x fsdp axes.
  data_par = mesh.get("data", 1) * mesh.get("fsdp", 1)
  batches = {"sft.batch_size": c.sft.batch_size,
             "rl.prompts_per_step * rl.group_size": c.rl.prompts_per_step * c.rl.group_size,
             f"mopd batch ({len(grid.cells)} cells * mopd.prompts_per_cell)":
             len(grid.cells) * c.mopd.prompts_per_cell}
  for name, size in batches.items():
    if size % data_par:
      raise ValueError(f"{name} = {size} is not a positive multiple of the data x fsdp mesh "
                       f"size {data_par}")
  outside_teacher(c)  # raises on a bad outside-teacher ablation
  if c.teacher.hf_paths and len(c.teacher.hf_paths) != len(grid.names):
    raise ValueError(f"teacher.hf_paths has {len(c.teacher.hf_paths)} entries; expected "
                     f"{len(grid.names)} in the grid's order {grid.names}")
  return grid
