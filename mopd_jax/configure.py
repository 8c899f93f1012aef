"""Builds a run's `RunConfig` (mopd_jax.config.schema): the schema's checked blocks (mopd_jax/config/schema.py)
resolved against the registered tasks and verifiers, and the rules of the algorithms that
own a value (the RL reference spec, the lane processes, the profiled loop, the MOPD prompt
mode). Entry points, the run context and tools call `build`; the schema itself imports no
algorithm.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Optional

import ml_collections

from mopd_jax.config import schema as config_mod
from mopd_jax.io import profiling, storage
from mopd_jax.stages import lanes
from mopd_jax.tasks import base as task_base, grid as grid_mod
from mopd_jax.training import mopd, registry, rl, sft, vocab_kl


def run_grid(config: ml_collections.ConfigDict) -> grid_mod.Grid:
  """The run's domains x efforts (`config.domains`, `config.efforts`; see mopd_jax.tasks.grid)."""
  return grid_mod.from_config(config, task_base.registered())


def model_config(config, vocab_size: int):
  """The student's ModelConfig of a RunConfig (or a ConfigDict): a preset with overrides,
  or a Hugging Face checkpoint's."""
  from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top  (safetensors on demand)
  block = config.model.mapping() if isinstance(config, config_mod.RunConfig) else config.model
  return hf.resolve_model_config(block, vocab_size)


def build(config: ml_collections.ConfigDict,
          num_devices: Optional[int]) -> config_mod.RunConfig:
  """The RunConfig of `config`, every check of the schema (mopd_jax/config/schema.py) and of
  the algorithms applied for a run on `num_devices` devices; None leaves out the mesh's
  device count, for an entry point that builds the config before jax.distributed starts
  (then `check_devices`). Raises ConfigError naming the field."""
  try:
    return _build(config, num_devices)
  except config_mod.ConfigError:
    raise
  except ValueError as e:
    raise config_mod.ConfigError(str(e)) from e


def import_plugins(spec: str) -> tuple:
  """Imports each module of `spec` (the config's `plugins`: comma-separated module names),
  whose losses and tasks register themselves on import; the module names. ValueError naming
  `plugins` for a module that cannot be imported."""
  mods = tuple(m.strip() for m in (spec or "").split(",") if m.strip())
  for name in mods:
    try:
      importlib.import_module(name)
    except ImportError as e:
      raise ValueError(f"plugins: cannot import {name!r} ({e}); name a module on the "
                       "Python path, e.g. --config.plugins=my_pkg.my_loss") from e
  return mods


def _losses(fields: dict) -> None:
  """Each stage's loss is one the registry holds for that stage, and its `loss_args` block
  names losses of that stage: the trained loss's block becomes its `LossKind.args`
  dataclass; another loss's block must keep that loss's defaults (a setting the run would
  not use is an error, not silence)."""
  for stage in ("rl", "mopd"):
    blk, known = fields[stage], registry.names(stage)
    if blk.loss not in known:
      raise ValueError(f"{stage}.loss={blk.loss!r}; expected one of {known}")
    given = dict(blk.loss_args or {})
    unknown = sorted(set(given) - set(known))
    if unknown:
      raise ValueError(f"{stage}.loss_args has block(s) {unknown} of no {stage} loss; the "
                       f"registered ones are {known} (a plugin loss: name its module in "
                       "plugins)")
    for other in sorted(set(given) - {blk.loss}):
      field = f"{stage}.loss_args.{other}"
      args = registry.loss_args(other, given[other], field)
      try:
        default = registry.default_args(other)
      except TypeError:  # its args have required fields: nothing to compare with
        continue
      if args != default:
        changed = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                   if getattr(args, f.name) != getattr(default, f.name)}
        raise ValueError(f"{field} sets {changed}, but {stage}.loss={blk.loss!r}: the "
                         f"setting would not be used (set {stage}.loss={other!r}, or drop it)")
    fields[stage] = dataclasses.replace(blk, loss_args=registry.loss_args(
        blk.loss, given.get(blk.loss), f"{stage}.loss_args.{blk.loss}"))


def _build(config: ml_collections.ConfigDict,
           num_devices: Optional[int]) -> config_mod.RunConfig:
  import_plugins(config.get("plugins", ""))
  fields = config_mod.schema_fields(config)
  _losses(fields)
  grid = run_grid(config)  # raises on unknown domains or efforts, naming the known ones
  known_domains = frozenset(dict(config.tasks or {})) | frozenset(task_base.registered())
  s = fields["sft"]
  fields["sft"] = dataclasses.replace(
      s, schedule=tuple(sft.schedule(s.schedule, grid.domains, known_domains)),
      style_weights=sft.domain_style_weights(s.style_weights, grid.domains, known_domains))
  records, task_options = _records(config, grid)
  if records and fields["budget"].count_with:
    raise ValueError(f"budget.count_with={fields['budget'].count_with!r} counts responses in "
                     "another tokenizer than the run's, but record domains "
                     f"{sorted(records)} measure their b0 in the run's tokenizer")
  rc = config_mod.RunConfig(**fields, grid=grid, known_domains=known_domains,
                            records=records, task_options=task_options,
                            tool_markers=_tool_markers(grid, records), source=config)
  config_mod.cross_checks(rc, num_devices)
  _algorithm_checks(rc)
  return rc


def _records(config, grid) -> dict:
  """(the RecordsSpec of each domain of the grid that runs the `records` task, the options of
  each other domain): a task block of another task holds `task` and the task's own options,
  the keyword arguments of its constructor (checked by building the task once)."""
  from mopd_jax.tasks import verifiers  # pylint: disable=g-import-not-at-top
  out, options = {}, {}
  for d in grid.domains:
    block = dict((config.tasks or {}).get(d) or {})
    name = f"tasks.{d}"
    if grid.task_of(d) != "records":
      options[d] = _task_options(grid.task_of(d), block, name)
      continue
    spec = config_mod.records_spec(block, name)
    if spec.verifier not in verifiers.registered():
      raise ValueError(f"{name}.verifier={spec.verifier!r}; registered verifiers: "
                       f"{list(verifiers.registered())}")
    paths = {}
    for split in ("train", "test"):
      p = getattr(spec, split)
      if not p:
        raise ValueError(f"{name}.{split} must name a JSONL or Parquet file")
      paths[split] = storage.join(p)  # absolute, so the lanes' processes read the same
    out[d] = dataclasses.replace(spec, **paths)
  return out, options


def _task_options(task: str, block: dict, name: str) -> dict:
  """The options a `tasks.<domain>` block gives its (non-records) task: its fields but
  `task`, each a keyword argument of the task's constructor; ValueError naming the field for
  an unknown one, or the block for a value the task refuses."""
  cls = task_base.task_class(task)
  params = inspect.signature(cls.__init__).parameters
  allowed = sorted(k for k, p in params.items() if k != "self" and
                   p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
  given = {k: (v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v)
           for k, v in block.items() if k != "task"}
  extra = sorted(set(given) - set(allowed))
  if extra:
    raise ValueError(f"{name} has field(s) {extra}; a domain of task {task!r} takes only "
                     f"'task' and its options {allowed}")
  if given:
    try:
      task_base.get_task(task, **given)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{name}: task {task!r} refuses its options {given}: {e}") from e
  return given


def _tool_markers(grid, records: dict) -> tuple:
  """RunConfig.tool_markers; ValueError when two domains write different markers (one
  tokenizer has one set)."""
  from mopd_jax.tasks import verifiers  # pylint: disable=g-import-not-at-top
  needed = {}
  for d in grid.domains:
    spec = records.get(d)
    markers = (verifiers.tool_markers(spec.verifier) if spec is not None else
               task_base.task_class(grid.task_of(d)).tool_markers)
    if markers:
      needed.setdefault(tuple(markers), d)
  if len(needed) > 1:
    raise ValueError("domains " + " and ".join(f"{d!r} ({' '.join(m)})" for m, d in
                                                needed.items()) +
                     " write different tool markers; a run's tokenizer has one set")
  return next(iter(needed), ())


def _algorithm_checks(c: config_mod.RunConfig) -> None:
  """The values whose rules live with the algorithm that reads them."""
  refs = rl.references(c.rl.reference, c.grid.anneal_order)  # raises on a bad spec
  if set(refs.values()) != {"sampler"} and not registry.LOSS_KINDS[c.rl.loss].fixed_reference:
    raise ValueError(f"rl.reference={c.rl.reference!r} holds PMD's old policy "
                     f"fixed for an effort phase; it needs rl.loss="
                     f"{_those('rl', 'fixed_reference')}, got {c.rl.loss!r}")
  if c.rl.partial_rollout_tokens and c.rl.sample_from == "both" and \
      set(refs.values()) != {"sampler"}:
    raise ValueError("rl.partial_rollout_tokens with rl.sample_from='both': a budget phase "
                     "held to a fixed reference draws half of each group from it, and a "
                     "group must be drawn whole in one step; partial rollouts pause and "
                     "resume rows across steps. Use rl.sample_from='policy' or 'reference', "
                     "or rl.partial_rollout_tokens=0")
  lanes.check_processes(c.rl)
  profiling.spec_from_config(c.profile, "")  # raises on a loop name it cannot trace
  m = c.mopd
  kind = registry.LOSS_KINDS[m.loss]
  mopd.prompt_mode(m.prompts_across_efforts, m.effort_mix, c.grid.effort_names)
  weighted = m.staleness or (m.partial_rollout_tokens and m.partial_mode == "importance")
  if weighted and not kind.importance_weights:
    what = "mopd.staleness=1" if m.staleness else "mopd.partial_mode='importance'"
    raise ValueError(f"{what} weights the loss by truncated importance weights; it needs "
                     f"mopd.loss={_those('mopd', 'importance_weights')}, got {m.loss!r}")
  if kind.needs_outcome and not m.alpha > 0:
    raise ValueError(f"mopd.loss={m.loss!r} trains on mopd.alpha x the rollouts' outcome "
                     f"advantages; it needs mopd.alpha > 0, got {m.alpha!r}")
  other = _other_tokenizers(c.teacher)
  if kind.char_targets:
    _check_char_targets(c, m.loss)
  elif other and (kind.topk or kind.teachers_in_step):
    raise ValueError(f"mopd.loss={m.loss!r} compares the student's and the teacher's "
                     "next-token distributions over one vocabulary; teachers of another "
                     f"tokenizer ({other}) score spans of the response: use mopd.loss='mopd'")
  if kind.teachers_in_step:
    vocab_kl.check_config(m, teachers=c.placement.teachers, endpoints=c.teacher.endpoints)
  if m.init_target == "distribution" and m.init != "teacher_sft":
    raise ValueError(f"mopd.init_target='distribution' sets what the teacher-SFT init fits; "
                     f"it needs mopd.init='teacher_sft', got {m.init!r}")
  if m.init_target == "distribution" and other:
    raise ValueError("mopd.init_target='distribution' fits the student's next-token "
                     "distribution to the teacher's over one vocabulary; teachers of another "
                     f"tokenizer ({other}) need mopd.init_target='tokens'")


def _check_char_targets(c, loss: str) -> None:
  """What a loss of the teachers' next-character distributions needs: teachers of another
  tokenizer (`teacher.tokenizer_path`, or per cell `teacher.tokenizer_paths`), in this
  process or served (their top `teacher.served_top_k`). The student's being
  character-level is checked at the MOPD stage's start."""
  t = c.teacher
  why = (f"mopd.loss={loss!r} reads the next-character distributions of teachers of another "
         "tokenizer")
  if not t.tokenizer_path and not t.tokenizer_paths:
    raise ValueError(f"{why}; it needs teacher.tokenizer_path or teacher.tokenizer_paths, "
                     "got neither")


def _other_tokenizers(t) -> str:
  """How the config names teachers of another tokenizer than the student's, for an error
  ("" = none named)."""
  named = []
  if t.tokenizer_path:
    named.append(f"teacher.tokenizer_path={t.tokenizer_path!r}")
  if t.tokenizer_paths:
    named.append(f"teacher.tokenizer_paths={dict(t.tokenizer_paths)!r}")
  return ", ".join(named)


def _those(stage: str, prop: str) -> str:
  """The registered losses of `stage` that have the LossKind property `prop`, as the config
  would name them ('pmd', or 'a' or 'b')."""
  return " or ".join(repr(n) for n in registry.names(stage)
                     if getattr(registry.LOSS_KINDS[n], prop))
