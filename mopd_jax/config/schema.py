"""The run config as one typed, validated value, built before anything compiles.

A run config is the ConfigDict of `configs/base.py` with a file's overrides (toy.py,
qwen3_mopd.py) and the command line's. `mopd_jax.configure.build(config, num_devices)` turns it into a
`RunConfig`: frozen dataclasses per block (`SftConfig`, `RlConfig`, `MopdConfig`, ...), every
field checked by the checker in its metadata (type, finiteness, sign or range, enum), the
task grid resolved (unknown domain or effort names list the known ones), and the cross-field
rules applied (batch sizes over the mesh, losses that need one another). Stages read only
the RunConfig: no field has a default outside `configs/base.py`, and a field a config file
adds that the schema does not know is an error.

The schema sits at the bottom of the import graph: it imports only the leaf modules
`config.choices`, `config.checks` (the field checkers), `teachers.endpoints` and
`io.tokenizer_options`. What needs the registered tasks, the verifiers or an algorithm's own
rule (the grid, the record domains, the RL reference spec...) is resolved by
mopd_jax/configure.py, which builds the RunConfig.
Checks `raise ConfigError` (a ValueError), never `assert`: the command line tells a bad
value from a failure inside a stage."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Mapping, Optional

import ml_collections

from mopd_jax.config.blocks import (BudgetConfig, DataConfig, DistributedConfig, EvalConfig,
                                    MopdConfig, PlacementConfig, ProfileConfig, PromptConfig,
                                    RecordsSpec, RlConfig, RolloutConfig, SandboxConfig,
                                    SftConfig, SmokeConfig)
from mopd_jax.config.checks import (Bool, DirPattern, Endpoints, HfPaths, Int, Num, OneOf, Raw,
                                    Sizes, Str, field as _f)
from mopd_jax.config import endpoints
from mopd_jax.config.tokenizer_options import TokenizerOptions

# Top-level blocks that tools other than the pipeline read (benchmarks/memory_plan.py).
TOOL_BLOCKS = ("plan",)


class ConfigError(ValueError):
  """A config value or command-line flag that is not allowed; the message names the field,
  the value and what is allowed."""




def _fields_of(value, name: str, required) -> dict:
  """The block `value` as a dict of plain values, with every `required` field present."""
  if not isinstance(value, (ml_collections.ConfigDict, Mapping)):
    raise ValueError(f"{name} must be a block of fields, got {value!r}")
  given = {k: Raw()(k, v) for k, v in dict(value).items()}
  missing = sorted(set(required) - set(given))
  if missing:
    raise ValueError(f"{name} lacks {[f'{name}.{k}' for k in missing]}; start the config from "
                     "configs/base.py, which defines every field")
  return given


def _block(cls, value, name: str):
  """`cls` from the ConfigDict block `value`: every field present, none unknown, each
  checked by its field's checker."""
  fields = {f.name: f for f in dataclasses.fields(cls)}
  given = _fields_of(value, name, fields)
  unknown = sorted(set(given) - set(fields))
  if unknown:
    raise ValueError(f"unknown field(s) {[f'{name}.{k}' for k in unknown]}; the fields of "
                     f"{name} are {sorted(fields)}")
  return cls(**{k: f.metadata["check"](f"{name}.{k}", given[k]) for k, f in fields.items()})


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int = _f(Int())


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The `model` block: a preset (or a Hugging Face checkpoint) and its overrides. Fields
  other than these six are ModelConfig overrides, checked when the ModelConfig is built
  (mopd_jax.io.hf.resolve_model_config)."""
  preset: str
  hf_path: str  # student checkpoint dir; "" = the preset
  tokenizer_path: str  # a tokenizer.json; "" = the toy CharTokenizer
  quant: str
  quant_group: int
  remat: str
  overrides: dict

  def mapping(self) -> dict:
    """The block as hf.resolve_model_config reads it."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k != "overrides"} | dict(
        self.overrides)


# The parity probe's default tolerance by the servers' compute dtype: each sits between the
# rounding gap of the same teachers in that dtype and the smallest mismatch measured (seed 0's
# toy teachers at T=0.5, `python -m experiments.teacher_parity`, docs/teacher_server.md):
# float32 rounding 8.3e-07 at most, bfloat16's 0.086 at most; the nearest mismatch (another
# cell's teacher) 0.53 at least.
PARITY_TOLERANCE = {"float32": 0.01, "bfloat16": 0.2}


@dataclasses.dataclass(frozen=True)
class TeacherSpec:
  """The `teacher` block: Hugging Face teachers ("domain/effort" -> checkpoint directory,
  one per cell) with their model overrides, the outside-teacher ablation, whether the
  teachers see the effort in their prompts, and teacher servers to score against
  (`endpoints`: "domain/effort" -> URLs, mopd_jax/teachers/client.py; {} = in-process)."""
  hf_paths: dict
  outside_cell: str
  outside_seed: int
  effort_in_prompt: bool
  endpoints: dict  # "domain/effort" -> (url, ...): replicas of that cell's teacher server
  endpoint_timeout_s: float  # per scoring request
  endpoint_retries: int  # tries after the first, with backoff, before the run stops
  parity_tolerance: float  # the parity probe's largest mean |delta log p| per token; 0: by dtype
  server_dtype: str  # what the teacher servers compute in: picks the default tolerance
  api_key_env: str  # environment variable holding the servers' API key ("" = none)
  probe_every: int  # MOPD steps between parity probes of the servers (0 = at start only)
  tokenizer_path: str  # the teachers' own tokenizer when not the student's ("" = the student's)
  tokenizer_paths: dict  # "domain/effort" -> that cell's teacher's tokenizer (else tokenizer_path)
  span_reward: str  # another tokenizer: how a span's reward reaches its student tokens
  served_top_k: int  # char_kl with teacher.endpoints: next tokens read per position
  model: dict  # preset and ModelConfig overrides of Hugging Face teachers

  def mapping(self) -> dict:
    return dict(self.model)

  def tolerance(self) -> float:
    """The parity probe's tolerance: `parity_tolerance`, or (0) the default of the servers'
    compute dtype (`PARITY_TOLERANCE`)."""
    return self.parity_tolerance or PARITY_TOLERANCE[self.server_dtype]

  def api_key(self) -> Optional[str]:
    """The servers' API key from the environment variable `api_key_env` names (None when
    none is named); ValueError when the variable is unset or empty."""
    if not self.api_key_env:
      return None
    key = os.environ.get(self.api_key_env, "")
    if not key:
      raise ValueError(f"teacher.api_key_env={self.api_key_env!r}, but that environment "
                       "variable is unset or empty")
    return key

  def retry_policy(self) -> endpoints.RetryPolicy:
    return endpoints.RetryPolicy(timeout_s=self.endpoint_timeout_s,
                                      retries=self.endpoint_retries)


_MODEL_CHECKS = {"preset": Str(), "hf_path": Str(), "tokenizer_path": Str(),
                 "quant": OneOf(("none", "int8", "int4")), "quant_group": Int(),
                 "remat": OneOf(("none", "block", "dots"))}


_TEACHER_CHECKS = {"hf_paths": HfPaths(), "outside_cell": Str(), "outside_seed": Int(0),
                   "effort_in_prompt": Bool(), "endpoints": Endpoints(),
                   "endpoint_timeout_s": Num(strict=True), "endpoint_retries": Int(0),
                   "parity_tolerance": Num(), "api_key_env": Str(),
                   "server_dtype": OneOf(tuple(PARITY_TOLERANCE)),
                   "probe_every": Int(0), "tokenizer_path": Str(),
                   "tokenizer_paths": HfPaths("tokenizer file", "domain/effort=file"),
                   "span_reward": OneOf(("spread", "last")), "served_top_k": Int(1)}


def _split(value, name: str, checks: Mapping) -> tuple:
  """(checked named fields, the rest as plain values) of a model-like block."""
  given = _fields_of(value, name, checks)
  named = {k: check(f"{name}.{k}", given.pop(k)) for k, check in checks.items()}
  return named, given


_BLOCKS = {"checkpoint": CheckpointConfig, "placement": PlacementConfig,
           "distributed": DistributedConfig, "data": DataConfig, "budget": BudgetConfig,
           "prompt": PromptConfig, "sft": SftConfig,
           "rl": RlConfig, "mopd": MopdConfig, "rollout": RolloutConfig, "eval": EvalConfig,
           "sandbox": SandboxConfig,
           "profile": ProfileConfig, "smoke": SmokeConfig}
_TOP = {"seed": Int(0), "stages": Str(), "log_every": Int(), "skip_nonfinite": Bool(),
        "compile_cache": DirPattern(), "plugins": Str()}


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A whole run config, typed and checked (`build`). `source` is the ConfigDict it was
  built from: what the lane subprocesses receive and what report.json records."""
  seed: int
  stages: tuple
  log_every: int
  skip_nonfinite: bool
  compile_cache: str
  plugins: str  # modules imported before the config is resolved (their losses, tasks)
  grid: "grid.Grid"  # mopd_jax/tasks/grid.py
  known_domains: frozenset  # domains any config block or registered task defines
  checkpoint: CheckpointConfig
  model: ModelSpec
  teacher: TeacherSpec
  mesh: dict
  placement: PlacementConfig
  distributed: DistributedConfig
  data: DataConfig
  budget: BudgetConfig
  prompt: PromptConfig
  records: dict  # domain -> RecordsSpec, for the domains that run the `records` task
  task_options: dict  # domain -> its task's options (its tasks.<domain> block), the others
  # The four tool markers (call, call end, observation, observation end) the domains of the
  # run write, or () when none uses tools (the tokenizer then needs none).
  tool_markers: tuple
  sft: SftConfig
  rl: RlConfig
  mopd: MopdConfig
  rollout: RolloutConfig
  eval: EvalConfig
  sandbox: SandboxConfig
  profile: ProfileConfig
  smoke: SmokeConfig
  source: ml_collections.ConfigDict = dataclasses.field(compare=False, repr=False)

  def to_json(self, **kwargs) -> str:
    return self.source.to_json(**kwargs)

  @property
  def hash(self) -> str:
    return hashlib.sha256(self.source.to_json(sort_keys=True).encode()).hexdigest()[:16]

  def task_options_json(self, domain: str) -> str:
    """A domain's task options as the TFDS config that generates its data carries them ("":
    none, the task's defaults)."""
    options = self.task_options.get(domain) or {}
    return json.dumps(options, sort_keys=True) if options else ""

  def tokenizer_options(self) -> TokenizerOptions:
    """The options of tokenizer.HFTokenizer: the `prompt` block's and the tool markers of
    the run's domains."""
    return self.prompt.tokenizer_options(self.tool_markers)

  @property
  def outside(self) -> tuple:
    """(cell, seed) of the outside-teacher ablation (`teacher.outside_cell`, e.g. "gen/max":
    that cell's teacher is trained from a second SFT of seed `teacher.outside_seed`), or
    (None, None) when the ablation is off."""
    t = self.teacher
    return (t.outside_cell, t.outside_seed) if t.outside_cell else (None, None)


def schema_fields(config: ml_collections.ConfigDict) -> dict:
  """The fields of RunConfig that the schema alone checks (every block and top-level field,
  the model and teacher blocks, the mesh and the stage list), as keyword arguments."""
  known = set(_TOP) | set(_BLOCKS) | {"domains", "efforts", "tasks", "effort", "model",
                                      "teacher", "mesh"} | set(TOOL_BLOCKS)
  unknown = sorted(set(dict(config)) - known)
  if unknown:
    raise ValueError(f"unknown config field(s) {unknown}; known top-level fields: "
                     f"{sorted(known)}")
  missing = sorted(k for k in set(_TOP) | set(_BLOCKS) | {"model", "teacher", "mesh"}
                   if k not in config)
  if missing:
    raise ValueError(f"the config lacks {missing}; start it from configs/base.py, which "
                     "defines every field")
  top = {k: check(k, config[k]) for k, check in _TOP.items()}
  blocks = {k: _block(cls, config[k], k) for k, cls in _BLOCKS.items()}
  named, overrides = _split(config.model, "model", _MODEL_CHECKS)
  model = ModelSpec(**named, overrides=overrides)
  named, rest = _split(config.teacher, "teacher", _TEACHER_CHECKS)
  teacher = TeacherSpec(**named, model=rest)
  mesh = Sizes()("mesh", config.mesh)
  stages = tuple(s.strip() for s in top.pop("stages").split(",") if s.strip())
  return dict(top, stages=stages, model=model, teacher=teacher, mesh=mesh, **blocks)


def records_spec(block, name: str) -> RecordsSpec:
  """The RecordsSpec of a `tasks.<domain>` block of the `records` task, its fields checked
  (the verifier's name and the files are checked by mopd_jax/configure.py)."""
  return _block(RecordsSpec, block, name)


def check_devices(c: RunConfig, num_devices: int) -> None:
  """The mesh (with the teachers' sub-mesh when disaggregated) against the run's devices.
  Raises ConfigError."""
  n = math.prod(c.mesh.values())
  if c.placement.teachers == "disaggregated":
    n += math.prod(c.placement.teacher_mesh.values())
  if n != num_devices:
    raise ConfigError(f"mesh {c.mesh} (with the teacher placement {c.placement.teachers}) "
                      f"has {n} devices but {num_devices} are available")


def cross_checks(c: RunConfig, num_devices: Optional[int]) -> None:
  """The rules that tie fields together and need no algorithm; the device count unless
  `num_devices` is None."""
  grid = c.grid
  if c.placement.teachers == "disaggregated" and not c.placement.teacher_mesh:
    raise ValueError("placement.teachers='disaggregated' needs placement.teacher_mesh "
                     "(axis sizes of the teachers' sub-mesh)")
  if num_devices is not None:
    check_devices(c, num_devices)
  m = c.mopd
  weighted = m.staleness or (m.partial_rollout_tokens and m.partial_mode == "importance")
  if weighted and not m.is_bounds[0] <= 1 <= m.is_bounds[1]:
    raise ValueError(f"mopd.is_bounds must be (low, high) with 0 <= low <= 1 <= high, got "
                     f"{m.is_bounds}")
  if m.staleness and m.partial_rollout_tokens:
    raise ValueError("mopd.partial_rollout_tokens needs mopd.staleness=0: a step's in-flight "
                     "rows are decoded by the student that takes its update")
  # Every batch splits over the data x fsdp axes.
  data_par = c.mesh.get("data", 1) * c.mesh.get("fsdp", 1)
  batches = {"sft.batch_size": c.sft.batch_size,
             "rl.prompts_per_step * rl.group_size": c.rl.prompts_per_step * c.rl.group_size,
             f"mopd batch ({len(grid.cells)} cells * mopd.prompts_per_cell)":
             len(grid.cells) * m.prompts_per_cell}
  for name, size in batches.items():
    if size % data_par:
      raise ValueError(f"{name} = {size} is not a positive multiple of the data x fsdp mesh "
                       f"size {data_par}")
  _teacher_checks(c)
  if c.sandbox.timeout_s >= 600:
    raise ValueError(f"sandbox.timeout_s must be below 600 s, got {c.sandbox.timeout_s}")
  if c.prompt.effort_format != "token" and not c.model.tokenizer_path:
    raise ValueError(f"prompt.effort_format={c.prompt.effort_format!r} needs a Hugging Face "
                     "tokenizer (model.tokenizer_path); the toy's CharTokenizer puts the "
                     "effort as a token")


def _teacher_checks(c: RunConfig) -> None:
  """The `teacher` block against the grid, the seed and the SFT stage."""
  grid, t = c.grid, c.teacher
  if t.outside_cell:
    if t.outside_cell not in grid.names:
      raise ValueError(f"teacher.outside_cell={t.outside_cell!r} is not a teacher cell; "
                       f"expected one of {grid.names}")
    if t.hf_paths:
      raise ValueError("teacher.outside_cell needs teachers trained by the rl stage; it "
                       "cannot be combined with teacher.hf_paths")
    if c.sft.steps == 0:
      raise ValueError("teacher.outside_cell trains a second SFT from its own seed; it needs "
                       "sft.steps > 0")
    if t.outside_seed == c.seed:
      raise ValueError(f"teacher.outside_seed={t.outside_seed!r} must be an int other than "
                       f"the run's seed {c.seed} (the outside SFT needs its own init and "
                       "order)")
  for field in ("tokenizer_path", "tokenizer_paths"):
    if getattr(t, field) and not t.hf_paths:
      raise ValueError(f"teacher.{field} is the tokenizer of teachers brought as "
                       "checkpoints (teacher.hf_paths, also with teacher.endpoints: the run "
                       "reads their configs and the servers score them); the rl stage trains "
                       "teachers with the student's tokenizer")
  extra = sorted(set(t.tokenizer_paths) - set(grid.names))
  if extra:
    raise ValueError(f"teacher.tokenizer_paths names {extra}, not cells of the grid "
                     f"{grid.names}")
  for field, what in (("hf_paths", "a checkpoint directory"),
                      ("endpoints", "teacher server URLs")):
    given = getattr(t, field)
    if not given:
      continue
    missing = [n for n in grid.names if n not in given]
    extra = sorted(set(given) - set(grid.names))
    if missing or extra:
      raise ValueError(f"teacher.{field} must map every cell of the grid {grid.names} to "
                       f"{what}" + (f"; missing {missing}" if missing else "") +
                       (f"; not cells of the grid: {extra}" if extra else ""))
