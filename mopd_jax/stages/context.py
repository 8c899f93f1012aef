"""The run context: what the pipeline resolves once per run and builds the stages from.

`Run(config, workdir)` takes the run's typed, validated RunConfig (mopd_jax.config.schema,
built by `mopd_jax.configure.build`; stages read `ctx.config`, never the ConfigDict) and resolves,
once: the task grid, the tokenizer (its effort tokens are the grid's), the student's
ModelConfig, the student's and the teachers' meshes, the profile switch, the prompt view
(`ctx.view`: which effort each party's prompt carries, mopd_jax/tasks/views.py), the workdir's
files and the loop settings (`stages/loops.py`), and the collaborators the stages read
through (`stages/sources.py`: `data`, `engines`, `policies`, `teachers`). `stages/wiring.py`
builds each stage's inputs from these with plain functions; no stage sees the run itself,
and no input holds a method of it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from mopd_jax.config import schema as config_mod
from mopd_jax.io import profiling, storage
from mopd_jax.io.tokenizer import fingerprint, load_tokenizer
from mopd_jax.stages import loops, sources
from mopd_jax.tasks import base as task_base, views
from mopd_jax.teachers import placement


def teacher_tokenizer(config: config_mod.RunConfig, tok, path: Optional[str] = None, *,
                      field: str = "teacher.tokenizer_path"):
  """The teachers' tokenizer: `tok` (the student's) unless `path` (default
  `teacher.tokenizer_path`) names one that reads differently (its fingerprint). The
  teacher's own files name its specials (the student's `prompt.*_token` names are the
  student's); the tool markers are the run's. A missing or unreadable file is a config
  error naming `field`."""
  path = config.teacher.tokenizer_path if path is None else path
  if not path:
    return tok
  options = dataclasses.replace(config.tokenizer_options(), pad_token=None, bos_token=None,
                                eos_token=None, tool_tokens=None)
  try:
    teacher = load_tokenizer(path, efforts=config.grid.effort_names, options=options)
  except ValueError as e:
    raise config_mod.ConfigError(f"{field}={path!r}: {e}") from e
  return tok if fingerprint(teacher) == fingerprint(tok) else teacher


def teacher_tokenizers(config: config_mod.RunConfig, tok, default) -> dict:
  """{cell: (its teacher's tokenizer, the file it was read from)}: `default` (the
  `teacher.tokenizer_path` one, or `tok`) unless `teacher.tokenizer_paths` names the cell's
  own; a file named twice is read once, and one that reads as `default` or as another
  already read is that one (so that cells of one tokenizer share one object, whatever the
  grid's order)."""
  out, read = {}, {}
  for cell in config.grid.names:
    path = config.teacher.tokenizer_paths.get(cell)
    if path is None:
      out[cell] = (default, config.teacher.tokenizer_path if default is not tok else "")
      continue
    if path not in read:
      t = teacher_tokenizer(config, tok, path, field=f"teacher.tokenizer_paths[{cell!r}]")
      known = {id(o): o for o in (default, *read.values())}.values()
      same = [o for o in known if fingerprint(o) == fingerprint(t)]
      read[path] = same[0] if same else t
    t = read[path]
    out[cell] = (t, "" if t is tok else path)
  return out


def count_tokenizer(config: config_mod.RunConfig, tok):
  """The tokenizer responses are counted in against their budgets (`budget.count_with`), or
  None for the run's own; one that reads as `tok` is None. Unreadable: a config error."""
  spec = config.budget.count_with
  if not spec:
    return None
  try:
    counter = load_tokenizer(spec, efforts=config.grid.effort_names,
                             options=config.tokenizer_options())
  except ValueError as e:
    raise config_mod.ConfigError(f"budget.count_with={spec!r}: {e}") from e
  return None if fingerprint(counter) == fingerprint(tok) else counter


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
    # The teachers' tokenizer: the student's, or their own (`teacher.tokenizer_path`,
    # docs/cross_tokenizer.md); one that reads the same as the student's is the student's.
    self.teacher_tok = teacher_tokenizer(config, self.tok)
    # Each cell's teacher's tokenizer (`teacher.tokenizer_paths`): several families in one
    # run; `teacher_tok` is then None (no one tokenizer is the teachers').
    cell_toks = teacher_tokenizers(config, self.tok, self.teacher_tok)
    if len({id(t) for t, _ in cell_toks.values()}) > 1:
      self.teacher_tok = None
    from mopd_jax.io import hf  # pylint: disable=g-import-not-at-top  (safetensors on demand)
    self.model_cfg = hf.resolve_model_config(config.model.mapping(), self.tok.vocab_size)
    # The student's mesh, and the teachers' (the same one unless disaggregated).
    self.mesh, self.teacher_mesh = placement.config_meshes(config)
    self.taus = self.grid.taus
    self.data_dir = config.data.dir or storage.join(self.workdir, "data")
    self.files = loops.Workdir(self.workdir)
    # What the stages read through (stages/sources.py), built once here.
    self.data = sources.DataSource(config, data_dir=self.data_dir, files=self.files)
    self.engines = sources.Engines(config, self.tok, student_cfg=self.model_cfg,
                                   teacher_tok=self.teacher_tok,
                                   count_tok=count_tokenizer(config, self.tok))
    self.policies = sources.Policies(config, model_cfg=self.model_cfg, mesh=self.mesh)
    self.teachers = sources.TeacherSource(config, self.tok, policies=self.policies,
                                          teacher_mesh=self.teacher_mesh, files=self.files,
                                          cell_toks=cell_toks)
    self.loops = loops.Loops(self.files, every=config.checkpoint.every,
                             skip_nonfinite=config.skip_nonfinite,
                             params_like=self.policies.like, switch=self.profile)

  # --- files --------------------------------------------------------------------------------
  def path(self, *parts) -> str:
    """A path under the workdir (local or object storage: mopd_jax/io/storage.py)."""
    return self.files.path(*parts)

  def done(self, stage: str) -> bool:
    return self.files.done(stage)

  # --- tasks and data ------------------------------------------------------------------------
  def task(self, domain: str) -> task_base.Task:
    """A fresh instance of the task the domain runs (its examples labelled `domain`), with
    what it takes from the run (`Task.run_options`) and its `tasks.<domain>` options."""
    name = self.grid.task_of(domain)
    options = {**task_base.task_class(name).run_options(self.config, self.tok),
               **self.config.task_options.get(domain, {})}
    return task_base.get_task(name, domain=domain, **options)
