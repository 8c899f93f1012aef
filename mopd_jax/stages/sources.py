"""What the stages read through, each built once per run by the run context
(`stages/context.py`) and handed to a stage inside its `Inputs`: the datasets (`DataSource`),
the rollout engines (`Engines`), the student's params (`Policies`) and the teachers
(`TeacherSource`). A stage holds these objects, never the run; a test builds them (and so a
stage's inputs) from a RunConfig and a tokenizer without one.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.io import checkpoint, storage, tokenizer
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import sharding
from mopd_jax.stages import loops
from mopd_jax.teachers import bank as teachers, families as families_mod


class DataSource:
  """The run's datasets: each domain's splits (a record domain's with the b0s the rl stage
  measured, once they exist) and its training batches."""

  def __init__(self, config: config_mod.RunConfig, *, data_dir: str, files: loops.Workdir):
    self.config, self.grid, self.data_dir, self.files = config, config.grid, data_dir, files
    self._budgeted = {}  # (domain, split) -> budgets.BudgetedSource

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
    from mopd_jax.tasks import budgets, datasets  # pylint: disable=g-import-not-at-top  (TFDS)
    source = datasets.load_split(domain, split, self.data_dir, seed=self.config.seed,
                                 sizes=tuple(self.config.data.sizes),
                                 task=self.grid.task_of(domain),
                                 records=self.records_settings(domain),
                                 options=self.task_options(domain))
    path = self.budgets_path(domain)
    if measured_b0 and path is not None and storage.exists(path):
      key = (domain, split)  # written once by the rl stage: read and applied once
      if key not in self._budgeted:
        self._budgeted[key] = budgets.BudgetedSource(source, checkpoint.read_json(path)["b0"])
      return self._budgeted[key]
    return source

  def task_options(self, domain: str) -> str:
    """The domain's task options as its TFDS config carries them ("": the task's defaults)."""
    return self.config.task_options_json(domain)

  def budgets_path(self, domain: str) -> Optional[str]:
    """Where a record domain's measured b0s live (`budget.source=samples`), else None."""
    if domain not in self.config.records or self.config.budget.source != "samples":
      return None
    return self.files.path("budgets", f"{domain}.json")

  def iterator(self, domain: str, batch_size: int, salt: int, *, seed: Optional[int] = None):
    """Training batches; `seed` (default: the run's) sets the data order, not the data.
    A record domain is read by grain, each process from its own shard; a toy domain by the
    order-preserving ResumableIterator (mopd_jax/tasks/datasets.py)."""
    from mopd_jax.tasks import datasets  # pylint: disable=g-import-not-at-top  (TFDS)
    seed = self.config.seed if seed is None else seed
    cls = (datasets.GrainIterator if domain in self.config.records
           else datasets.ResumableIterator)
    return cls(self.split(domain, "train"), batch_size, seed=seed * 1000 + salt)


class Engines:
  """The rollout engines: one (and its compiled sampler) per (model, temperature)."""

  def __init__(self, config: config_mod.RunConfig, tok, *, student_cfg: models.ModelConfig,
               teacher_tok=None, count_tok=None):
    """`tok`: the student's tokenizer; `teacher_tok`: the teachers' (None: the same, unless
    the teachers are of several families: then each teacher engine is asked with its own);
    `count_tok`: the tokenizer responses are counted in against their budgets
    (`budget.count_with`; None: each engine's own, the teachers' engine of another
    tokenizer the student's)."""
    self.rollout_cfg, self.tok, self.student_cfg = config.rollout, tok, student_cfg
    self.teacher_tok = tok if teacher_tok is None else teacher_tok
    self.several_families = bool(config.teacher.tokenizer_paths) and teacher_tok is None
    self.count_tok = count_tok
    self.rl_temperature, self.eval_temperature = config.rl.temperature, config.eval.temperature

  @functools.lru_cache(maxsize=None)
  def make(self, model_cfg: models.ModelConfig, temperature: float,
           tok=None) -> rollout.RolloutEngine:
    """The engine of `model_cfg` sampling at `temperature` with `tok` (None: the
    student's tokenizer), built the first time asked."""
    c = self.rollout_cfg
    decode = rollout.DecodeOptions(temperature=temperature, dtype=c.sampling_dtype,
                                   decode_slots=c.decode_slots, admission=c.admission)
    count = self.count_tok
    if count is None and tok is not None and tok is not self.tok:
      count = self.tok  # another tokenizer's engine counts in the student's tokens
    return rollout.RolloutEngine(model_cfg, self.tok if tok is None else tok,
                                 max_response_tokens=c.max_response_tokens,
                                 max_turns=c.max_turns, decode=decode, count_tok=count)

  @property
  def student(self) -> rollout.RolloutEngine:
    """The student's sampling engine (RL and MOPD rollouts)."""
    return self.make(self.student_cfg, self.rl_temperature)

  @property
  def eval(self) -> rollout.RolloutEngine:
    return self.make(self.student_cfg, self.eval_temperature)

  def teacher(self, model_cfg: models.ModelConfig, temperature: float,
              tok=None) -> rollout.RolloutEngine:
    """The teachers' engine: their model, their tokenizer (`tok`, default the teachers'; the
    student's tokenizer: the engine `make` gives, shared with the student's policies of
    that model)."""
    if tok is None and self.several_families:
      raise ValueError("teachers of several families have no one tokenizer: ask for a "
                       "teacher engine with its family's (tok=)")
    tok = self.teacher_tok if tok is None else tok
    if tok is self.tok:
      return self.make(model_cfg, temperature)
    return self.make(model_cfg, temperature, tok)


class Policies:
  """The student's params: the target every checkpoint restores onto, the policy SFT starts
  from, and a saved policy loaded."""

  def __init__(self, config: config_mod.RunConfig, *, model_cfg: models.ModelConfig, mesh):
    self.model_cfg, self.mesh = model_cfg, mesh
    self.hf_path, self.seed = config.model.hf_path, config.seed

  def like(self):
    """Shapes, dtypes and the student mesh's shardings of the params: the target every
    checkpoint restores onto (each process reads only its own shards)."""
    shapes = jax.eval_shape(lambda: models.init_params(self.model_cfg, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, sharding.param_shardings(self.model_cfg, self.mesh))

  def initial(self, seed: Optional[int] = None):
    """The policy SFT starts from: a Hugging Face checkpoint (`model.hf_path`) or a fresh
    init (from `seed`, default the run's)."""
    shardings = sharding.param_shardings(self.model_cfg, self.mesh)
    if self.hf_path:
      from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top  (safetensors on demand)
      _, params = hf.load_checkpoint(self.hf_path, sharding=shardings,
                                     vocab_size=self.model_cfg.vocab_size)
      return params
    return models.init_params(self.model_cfg, jax.random.PRNGKey(
        self.seed if seed is None else seed), out_shardings=shardings)

  def load(self, path: str):
    """The policy saved at `path`, restored onto `like()`."""
    return checkpoint.load_params(path, self.like())


class TeacherSource:
  """The run's teachers: their ModelConfig (the student's for teachers the rl stage trains,
  their own for Hugging Face checkpoints, `teacher.hf_paths`), one teacher's params from its
  manifest entry, and the grid's bank stacked and placed once on the teachers' mesh: one
  bank, or with teachers of several families (tokenizers, `teacher.tokenizer_paths`, or
  model shapes) a `families.MixedBank` of one bank per family."""

  def __init__(self, config: config_mod.RunConfig, tok, *, policies: Policies, teacher_mesh,
               files: loops.Workdir, cell_toks: Optional[dict] = None):
    """`tok`: the student's tokenizer; `cell_toks`: {cell: (its teacher's tokenizer, the
    file it was read from, "" for the student's)} (None: every cell the student's)."""
    self.config, self.grid, self.student_tok = config, config.grid, tok
    self.policies, self.teacher_mesh, self.files = policies, teacher_mesh, files
    self.cell_toks = cell_toks or {c: (tok, "") for c in config.grid.names}
    # The teachers' tokenizer when they share one (else the first cell's: see `families`).
    self.tok = next(iter(self.cell_toks.values()))[0]

  @property
  def hf_paths(self) -> dict:
    """"domain/effort" -> Hugging Face checkpoint of that cell's teacher; {} = trained."""
    return dict(self.config.teacher.hf_paths)

  def resolve_hf(self, path: str, tok=None) -> models.ModelConfig:
    from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top  (safetensors on demand)
    return hf.resolve_model_config(self.config.teacher.mapping(),
                                   (tok or self.tok).vocab_size, hf_path=path)

  @functools.cached_property
  def families(self) -> tuple:
    """The run's teacher families (`families.Family`): the cells whose teachers share one
    tokenizer and one ModelConfig, in the grid's order of their first cell. Teachers the rl
    stage trains are one family, the student's."""
    if not self.hf_paths:
      return (families_mod.Family(tok=self.student_tok, path="", cross=False,
                                  model_cfg=self.policies.model_cfg, cells=self.grid.names),)
    groups = {}
    for cell in self.grid.names:
      tok, path = self.cell_toks[cell]
      cfg = self.resolve_hf(self.hf_paths[cell], tok)
      if tok is self.student_tok:  # the student's vocabulary: its family and size
        teachers.check_compatible(self.policies.model_cfg, cfg)
      groups.setdefault((id(tok), cfg), (tok, path, cfg, []))[3].append(cell)
    return tuple(families_mod.Family(tok=t, path=p, model_cfg=cfg, cells=tuple(cells),
                                     cross=t is not self.student_tok)
                 for t, p, cfg, cells in groups.values())

  @property
  def mixed(self) -> bool:
    """Teachers of more than one family (tokenizer or model shape): a bank per family."""
    return len(self.families) > 1

  @property
  def model_cfg(self) -> models.ModelConfig:
    """Teachers trained by the rl stage share the student's shape; teachers brought as
    Hugging Face checkpoints (`teacher.hf_paths`) have their own (e.g. Qwen3-1.7B); of
    several families, each its own (`cell_model_cfg`)."""
    if self.mixed:
      raise ValueError("teachers of several families have no one ModelConfig; ask "
                       "cell_model_cfg(cell)")
    return self.families[0].model_cfg

  def family_of(self, cell: str) -> families_mod.Family:
    return next(f for f in self.families if cell in f.cells)

  def cell_model_cfg(self, cell: str) -> models.ModelConfig:
    return self.family_of(cell).model_cfg

  def load_one(self, entry: dict, cell: Optional[str] = None, *, placed: bool = False):
    """One teacher's params from its manifest entry (an orbax checkpoint or a Hugging Face
    one); `cell` names its family (None: the run's one family). An orbax checkpoint is
    restored onto the student's mesh; a Hugging Face one is read onto the host for the bank
    to stack, or with `placed` onto the student's mesh, sharded as its family's model
    (what a multi-process run samples with: every process reads its own shards)."""
    if entry.get("format") == "hf":
      from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top
      cfg = self.model_cfg if cell is None else self.cell_model_cfg(cell)
      _, params = hf.load_checkpoint(
          entry["path"], vocab_size=cfg.vocab_size,
          sharding=sharding.param_shardings(cfg, self.policies.mesh) if placed else None)
      return params
    return checkpoint.load_params(entry["path"], self.policies.like())

  def load_bank(self, manifest: Optional[str] = None):
    """The grid's teachers from the manifest (default: the workdir's teachers.json),
    checked against the run, stacked and placed once on the teachers' mesh
    (placement.TeacherScorer then holds no second copy): a TeacherBank, or a MixedBank of
    one per family."""
    path = manifest or self.files.path("teachers.json")
    if not self.mixed:
      shard = sharding.param_shardings(self.model_cfg, self.teacher_mesh,
                                       num_stacked=len(self.grid.names))
      return teachers.load_bank(path, self.grid, self.policies.model_cfg,
                                teacher_cfg=self.model_cfg, load_one=self.load_one,
                                resolve_hf=self.resolve_hf, sharding=shard,
                                tokenizer=self.tokenizer_record())
    records = self.tokenizer_records()
    recorded = checkpoint.read_json(path)
    teachers.validate_manifest(
        recorded, path, self.grid, student_cfg=self.policies.model_cfg,
        resolve_hf=lambda p: self.resolve_hf(p, self._tok_of_path(p)), cell_tokenizers=records)
    parts = []
    for f in self.families:
      shard = sharding.param_shardings(f.model_cfg, self.teacher_mesh, num_stacked=len(f.cells))
      plist = [self.load_one(recorded["teachers"][c], c) for c in f.cells]
      parts.append(teachers.build_bank(
          f.model_cfg, plist, names=f.cells, sharding=shard,
          student_cfg=None if f.cross else self.policies.model_cfg))
    return families_mod.MixedBank(parts=tuple(parts), router=teachers.Router(self.grid.names),
                                  families=self.families)

  def _tok_of_path(self, hf_path: str):
    """The tokenizer of the cell whose checkpoint is `hf_path` (the first cell's if none)."""
    return next((self.cell_toks[c][0] for c, p in self.hf_paths.items() if p == hf_path),
                self.tok)

  def _record(self, tok, path: str) -> dict:
    other = tok is not self.student_tok
    return {"path": path if other else "", "fingerprint": tokenizer.fingerprint(tok),
            "vocab_size": tok.vocab_size, "other": other}

  def tokenizer_record(self) -> dict:
    """What the manifest records of the teachers' tokenizer: its file, its fingerprint, its
    vocabulary size and whether it is another than the student's (one family's; of several,
    `tokenizer_records`)."""
    return self._record(self.tok, self.cell_toks[self.grid.names[0]][1])

  def tokenizer_records(self) -> dict:
    """{cell: the manifest's record of its teacher's tokenizer}."""
    return {c: self._record(t, p) for c, (t, p) in self.cell_toks.items()}

  def router_only(self):
    """A bank without params, the grid's router alone (teachers that score elsewhere); of
    several families, a MixedBank of such."""
    if self.mixed:
      return families_mod.MixedBank(
          parts=tuple(teachers.TeacherBank(params={}, model_cfg=f.model_cfg,
                                           router=teachers.Router(f.cells))
                      for f in self.families),
          router=teachers.Router(self.grid.names), families=self.families)
    return teachers.TeacherBank(params={}, model_cfg=self.model_cfg,
                                router=teachers.Router(self.grid.names))
