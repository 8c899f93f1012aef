"""The run config's stage blocks: one frozen dataclass per block of `configs/base.py`
(`sft`, `rl`, `mopd`, `eval`, ...), each field with its checker in its metadata
(mopd_jax/config/checks.py). `mopd_jax.config.schema` assembles them into the RunConfig and
applies the rules that span blocks.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from mopd_jax.config import choices
from mopd_jax.config.checks import (Bool, Int, Num, OneOf, Raw, Seq, Sizes, Str,
                                    field as _f)
from mopd_jax.config.tokenizer_options import TokenizerOptions


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
  teachers: str = _f(OneOf(choices.PLACEMENTS))
  teacher_mesh: dict = _f(Sizes())


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator_address: str = _f(Str())  # "" = JAX_COORDINATOR_ADDRESS or none
  num_processes: int = _f(Int(0))  # 0 = JAX_NUM_PROCESSES or auto
  process_id: int = _f(Int(-1))  # -1 = JAX_PROCESS_ID or auto
  initialize: bool = _f(Bool())


@dataclasses.dataclass(frozen=True)
class DataConfig:
  sizes: tuple = _f(Seq(Int(), 3))
  dir: str = _f(Str())
  max_prompt_tokens: int = _f(Int(0))  # 0 = no limit (record domains)
  on_too_long: str = _f(OneOf(choices.ON_TOO_LONG))


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
  source: str = _f(OneOf(("field", "reference", "samples")))
  samples: int = _f(Int())  # k of budget.source=samples
  count_with: str = _f(Str())  # the tokenizer a response's length is counted in ("" = the run's)


@dataclasses.dataclass(frozen=True)
class PromptConfig:
  chat_template: bool = _f(Bool())
  effort_format: str = _f(OneOf(choices.EFFORT_FORMATS))
  system_line: str = _f(Str())
  pad_token: str = _f(Str())
  bos_token: str = _f(Str())
  eos_token: str = _f(Str())
  tool_tokens: str = _f(Str())

  def tokenizer_options(self, tools: tuple) -> TokenizerOptions:
    """The options of tokenizer.HFTokenizer this block sets, with the tool markers `tools`
    the run's domains write (RunConfig.tokenizer_options)."""
    return TokenizerOptions(
        chat=self.chat_template, effort_format=self.effort_format,
        system_line=self.system_line, pad_token=self.pad_token or None,
        bos_token=self.bos_token or None, eos_token=self.eos_token or None,
        tool_tokens=tuple(t.strip() for t in self.tool_tokens.split(","))
        if self.tool_tokens else None, tools=tools)


@dataclasses.dataclass(frozen=True)
class RecordsSpec:
  """A `tasks.<domain>` block of the `records` task: the domain's data files (absolute
  paths), its verifier, and how many training records are held out for validation."""
  task: str = _f(Str())
  train: str = _f(Str())
  test: str = _f(Str())
  verifier: str = _f(Str())
  validation: int = _f(Int(1))


@dataclasses.dataclass(frozen=True)
class SftConfig:
  steps: int = _f(Int(0))  # 0 = the initial checkpoint is pi_SFT as it is
  schedule: Any = _f(Raw())  # resolved by build: the domain of each update, repeating
  style_weights: Any = _f(Raw())  # resolved by build: {domain: (w_full, w_brief, w_direct)}
  batch_size: int = _f(Int())
  lr: float = _f(Num(strict=True))
  warmup_steps: int = _f(Int(0))
  weight_decay: float = _f(Num())
  microbatches: int = _f(Int())
  effort_mode: str = _f(OneOf(("random", "style")))


@dataclasses.dataclass(frozen=True)
class RlConfig:
  loss: str = _f(Str())  # a loss registered for the rl stage (checked by configure)
  loss_args: Any = _f(Raw())  # {loss: its hyperparameters}; configure keeps the trained loss's
  steps_per_effort: int = _f(Int())
  prompts_per_step: int = _f(Int())
  group_size: int = _f(Int())
  microbatches: int = _f(Int())
  length_groups: int = _f(Int())
  reference: str = _f(Str())  # checked by build against the grid's phases (rl.references)
  sample_from: str = _f(OneOf(("policy", "reference", "both")))
  lr: float = _f(Num(strict=True))
  tau_kl: float = _f(Num(strict=True))
  anneal_lr: float = _f(Num())
  anneal_tau_kl: float = _f(Num())
  anneal_steps: int = _f(Int(0))
  plateau_window: int = _f(Int(0))
  plateau_delta: float = _f(Num())
  temperature: float = _f(Num())
  validation_examples: int = _f(Int(0))
  lane_processes: int = _f(Int())
  partial_rollout_tokens: int = _f(Int(0))
  partial_mode: str = _f(OneOf(choices.PARTIAL_MODES))


@dataclasses.dataclass(frozen=True)
class MopdConfig:
  steps: int = _f(Int())
  prompts_per_cell: int = _f(Int())
  prompts_across_efforts: str = _f(OneOf(choices.PROMPT_MODES))
  effort_mix: tuple = _f(Seq(Num()))
  lr: float = _f(Num(strict=True))
  warmup_steps: int = _f(Int(0))
  microbatches: int = _f(Int())
  length_groups: int = _f(Int())
  r_max: float = _f(Num(strict=True))
  teacher_temperature: float = _f(Num(strict=True))
  loss: str = _f(Str())  # a loss registered for the mopd stage (checked by configure)
  loss_args: Any = _f(Raw())  # {loss: its hyperparameters}; configure keeps the trained loss's
  alpha: float = _f(Num())
  staleness: int = _f(OneOf((0, 1)))
  is_bounds: tuple = _f(Seq(Num(), 2))
  init: str = _f(OneOf(("sft", "teacher_sft")))
  start_temperature: float = _f(Num(strict=True))
  init_samples_per_cell: int = _f(Int())
  init_sft_steps: int = _f(Int())
  init_lr: float = _f(Num(strict=True))
  init_warmup_steps: int = _f(Int(0))
  init_target: str = _f(OneOf(choices.INIT_TARGETS))
  init_top_k: int = _f(Int(0))  # 0 = the whole vocabulary
  exact_kl_every: int = _f(Int(0))
  partial_rollout_tokens: int = _f(Int(0))
  partial_mode: str = _f(OneOf(choices.PARTIAL_MODES))

  @property
  def shared(self) -> bool:
    return self.prompts_across_efforts == "shared"


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  max_response_tokens: int = _f(Int())
  max_turns: int = _f(Int(0))
  width: int = _f(Int())
  sampling_dtype: str = _f(OneOf(("float32", "bfloat16")))
  decode_slots: int = _f(Int(0))
  admission: str = _f(OneOf(("longest_cap_first", "fifo")))


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  backend: str = _f(OneOf(("auto", "bwrap", "inprocess")))
  workers: int = _f(Int())
  timeout_s: float = _f(Num(strict=True))
  memory_mb: int = _f(Int(64))

  def task_options(self) -> dict:
    """The keyword arguments of a task that runs code (its `Task.run_options`)."""
    return dict(backend=None if self.backend == "auto" else self.backend,
                workers=self.workers, timeout_s=self.timeout_s, memory_mb=self.memory_mb)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  num_examples: int = _f(Int())
  temperature: float = _f(Num())
  samples: int = _f(Int(0))
  sample_temperature: float = _f(Num(strict=True))
  teacher_logratio: bool = _f(Bool())
  kl_rollouts: int = _f(Int(0))


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  stage: str = _f(Str())  # checked by mopd_jax.io.profiling (a loop's name)
  start_step: int = _f(Int(0))
  num_steps: int = _f(Int())


@dataclasses.dataclass(frozen=True)
class SmokeConfig:
  prompts: tuple = _f(Seq(Str()))
  max_new_tokens: int = _f(Int())
