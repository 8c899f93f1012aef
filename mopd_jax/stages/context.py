"""The run context: what the pipeline resolves once per run and builds the stages from.

`Run(config, workdir)` takes the run's typed, validated RunConfig (mopd_jax.config.schema,
built by `mopd_jax.configure.build`; stages read `ctx.config`, never the ConfigDict) and resolves,
once: the task grid, the tokenizer (its effort tokens are the grid's), the student's
ModelConfig, the student's and the teachers' meshes, the profile switch, the prompt view
(`ctx.view`: which effort each party's prompt carries, mopd_jax/tasks/views.py), the workdir's
files and the loop settings (`stages/loops.py`). `stages/wiring.py` builds each stage's
inputs from it (paths, rollout engines, data splits and iterators, teachers, loggers and
checkpointed loops); no stage sees the run itself.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.io import checkpoint, profiling, storage
from mopd_jax.io.tokenizer import load_tokenizer
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import sharding
from mopd_jax.stages import loops
from mopd_jax.tasks import base as task_base, views
from mopd_jax.teachers import bank as teachers, placement


class Run:
  """What every stage needs: config, workdir, grid, tokenizer, model config, meshes."""

  def __init__(self, config: config_mod.RunConfig, workdir: str):
    """`config`: the run's RunConfig (`mopd_jax.configure.build(config_dict, num_devices)`)."""
    if not isinstance(config, config_mod.RunConfig):
      raise TypeError(f"Run takes the run's RunConfig, got {type(config).__name__}: build it "
                      "with mopd_jax.configure.build(config, jax.device_count())")
    self.config = config
    self.grid = config.grid
    self.workdir = storage.join(workdir)  # absolute if local; gs://... kept as it is
    self.profile = profiling.Switch(config.profile, self.workdir)
    # Which effort the student's, the teachers' and SFT's prompts carry (K3 eq. 15, or the
    # `teacher.effort_in_prompt` ablation): every stage asks this one view.
    self.view = views.PromptView.from_config(config.teacher)
    try:  # a tokenizer the config cannot use is a config error: one line, exit status 2
      self.tok = load_tokenizer(config.model.tokenizer_path or "char",
                                efforts=self.grid.effort_names,
                                options=config.tokenizer_options())
    except ValueError as e:
      raise config_mod.ConfigError(str(e)) from e
    from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top  (safetensors on demand)
    self.model_cfg = hf.resolve_model_config(config.model.mapping(), self.tok.vocab_size)
    # The student's mesh, and the teachers' (the same one unless disaggregated).
    self.mesh, self.teacher_mesh = placement.config_meshes(config)
    self.taus = self.grid.taus
    self.data_dir = config.data.dir or storage.join(self.workdir, "data")
    self._budgeted = {}  # (domain, split) -> budgets.BudgetedSource
    self.files = loops.Workdir(self.workdir)
    self.loops = loops.Loops(self.files, every=config.checkpoint.every,
                             skip_nonfinite=config.skip_nonfinite, params_like=self.params_like,
                             switch=self.profile)

  # --- files --------------------------------------------------------------------------------
  def path(self, *parts) -> str:
    """A path under the workdir (local or object storage: mopd_jax/io/storage.py)."""
    return self.files.path(*parts)

  def done(self, stage: str) -> bool:
    return self.files.done(stage)

  # --- tasks and data ------------------------------------------------------------------------
  def task(self, domain: str) -> task_base.Task:
    """A fresh instance of the task the domain runs (its examples labelled `domain`)."""
    name = self.grid.task_of(domain)
    options = task_base.task_class(name).run_options(self.config, self.tok)
    return task_base.get_task(name, domain=domain, **options)

  def records_settings(self, domain: str) -> str:
    """A record domain's settings as its TFDS config carries them ("" for a generated
    domain): files, verifier, budgets, prompt limit, and the tokenizer that measures them."""
    spec = self.config.records.get(domain)
    if spec is None:
      return ""
    from mopd_jax.tasks import datasets  # pylint: disable=g-import-not-at-top  (TFDS)
    c = self.config
    return datasets.records_settings(
        spec, budget_source=c.budget.source,
        max_prompt_tokens=c.data.max_prompt_tokens, on_too_long=c.data.on_too_long,
        tokenizer=c.model.tokenizer_path, tokenizer_options=c.tokenizer_options().to_json(),
        efforts=self.grid.effort_names)

  def split(self, domain: str, split: str, measured_b0: bool = True):
    """A split's examples; a record domain with `budget.source=samples` gets the b0s the rl
    stage measured (mopd_jax/tasks/budgets.py) once they exist (`measured_b0=False`: the data
    stage's placeholders)."""
    from mopd_jax.tasks import datasets  # pylint: disable=g-import-not-at-top  (TFDS)
    source = datasets.load_split(domain, split, self.data_dir, seed=self.config.seed,
                                 sizes=tuple(self.config.data.sizes),
                                 task=self.grid.task_of(domain),
                                 records=self.records_settings(domain))
    path = self.budgets_path(domain)
    if measured_b0 and path is not None and storage.exists(path):
      key = (domain, split)  # written once by the rl stage: read and applied once
      if key not in self._budgeted:
        from mopd_jax.tasks import budgets  # pylint: disable=g-import-not-at-top
        self._budgeted[key] = budgets.BudgetedSource(source, checkpoint.read_json(path)["b0"])
      return self._budgeted[key]
    return source

  def budgets_path(self, domain: str):
    """Where a record domain's measured b0s live (`budget.source=samples`), else None."""
    if domain not in self.config.records or self.config.budget.source != "samples":
      return None
    return self.path("budgets", f"{domain}.json")

  def iterator(self, domain: str, batch_size: int, salt: int, *, seed: Optional[int] = None):
    """Training batches; `seed` (default: the run's) sets the data order, not the data.
    A record domain is read by grain, each process from its own shard; a toy domain by the
    order-preserving ResumableIterator (mopd_jax/tasks/datasets.py)."""
    from mopd_jax.tasks import datasets  # pylint: disable=g-import-not-at-top  (TFDS)
    seed = self.config.seed if seed is None else seed
    cls = (datasets.GrainIterator if domain in self.config.records
           else datasets.ResumableIterator)
    return cls(self.split(domain, "train"), batch_size, seed=seed * 1000 + salt)

  def budgets(self, examples, effort: str) -> list:
    return task_base.effort_budgets(examples, effort, self.taus)

  # --- models ----------------------------------------------------------------------------------
  @functools.lru_cache(maxsize=None)
  def make_engine(self, model_cfg: models.ModelConfig,
                  temperature: float) -> rollout.RolloutEngine:
    """One rollout engine (and its compiled sampler) per (model, temperature)."""
    c = self.config.rollout
    decode = rollout.DecodeOptions(temperature=temperature, dtype=c.sampling_dtype,
                                   decode_slots=c.decode_slots, admission=c.admission)
    return rollout.RolloutEngine(model_cfg, self.tok, max_response_tokens=c.max_response_tokens,
                                 max_turns=c.max_turns, decode=decode)

  @property
  def engine(self) -> rollout.RolloutEngine:
    """The student's sampling engine (RL and MOPD rollouts)."""
    return self.make_engine(self.model_cfg, self.config.rl.temperature)

  @property
  def eval_engine(self) -> rollout.RolloutEngine:
    return self.make_engine(self.model_cfg, self.config.eval.temperature)

  @property
  def teacher_hf_paths(self) -> dict:
    """"domain/effort" -> Hugging Face checkpoint of that cell's teacher; {} = trained."""
    return dict(self.config.teacher.hf_paths)

  def resolve_teacher_hf(self, path: str) -> models.ModelConfig:
    from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top  (safetensors on demand)
    return hf.resolve_model_config(self.config.teacher.mapping(), self.tok.vocab_size,
                                   hf_path=path)

  @functools.cached_property
  def teacher_cfg(self) -> models.ModelConfig:
    """Teachers trained by the rl stage share the student's shape; teachers brought as
    Hugging Face checkpoints (`teacher.hf_paths`) have their own (e.g. Qwen3-1.7B)."""
    if not self.teacher_hf_paths:
      return self.model_cfg
    cfg = self.resolve_teacher_hf(next(iter(self.teacher_hf_paths.values())))
    teachers.check_compatible(self.model_cfg, cfg)
    return cfg

  def load_teacher(self, entry: dict):
    if entry.get("format") == "hf":
      from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top
      _, params = hf.load_checkpoint(entry["path"], vocab_size=self.teacher_cfg.vocab_size)
      return params
    return checkpoint.load_params(entry["path"], self.params_like())

  def load_bank(self, manifest: Optional[str] = None) -> teachers.TeacherBank:
    """The grid's teachers from the manifest (default: the workdir's teachers.json),
    checked against the run, stacked and placed once on the teachers' mesh
    (placement.TeacherScorer then holds no second copy)."""
    shard = sharding.param_shardings(self.teacher_cfg, self.teacher_mesh,
                                     num_stacked=len(self.grid.names))
    return teachers.load_bank(manifest or self.path("teachers.json"), self.grid,
                              self.model_cfg, teacher_cfg=self.teacher_cfg,
                                  load_one=self.load_teacher,
                              resolve_hf=self.resolve_teacher_hf, sharding=shard)

  def params_like(self):
    """Shapes, dtypes and the student mesh's shardings of the params: the target every
    checkpoint restores onto (each process reads only its own shards)."""
    shapes = jax.eval_shape(lambda: models.init_params(self.model_cfg, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, sharding.param_shardings(self.model_cfg, self.mesh))

  def initial_params(self, seed: Optional[int] = None):
    """The policy SFT starts from: a Hugging Face checkpoint (`model.hf_path`) or a fresh
    init (from `seed`, default the run's)."""
    shardings = sharding.param_shardings(self.model_cfg, self.mesh)
    if self.config.model.hf_path:
      from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top
      _, params = hf.load_checkpoint(self.config.model.hf_path, sharding=shardings,
                                     vocab_size=self.model_cfg.vocab_size)
      return params
    return models.init_params(self.model_cfg, jax.random.PRNGKey(
        self.config.seed if seed is None else seed), out_shardings=shardings)
