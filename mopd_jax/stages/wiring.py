"""Where the pipeline builds each stage's inputs from the run (`context.Run`): the one place
that knows which collaborators a stage gets. Every stage takes a frozen `Inputs` of its own
and never sees the run.

    STAGES["mopd"](run)   # = mopd.run(mopd_inputs(run))
"""
from __future__ import annotations

import weakref

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.io import checkpoint, tokenizer
from mopd_jax.runtime import distributed
from mopd_jax.stages import data, eval as eval_stage, mopd, report, rl, sft, smoke
from mopd_jax.stages.context import Run
from mopd_jax.teachers import (bank as teachers, char_marginal, char_served, families, parity,
                               placement, source)
from mopd_jax.training import mopd as mopd_lib, registry as loss_kinds


def smoke_inputs(ctx: Run) -> smoke.Inputs:
  """The smoke stage's inputs: its config block, the tokenizer, the initial policy."""
  return smoke.Inputs(cfg=ctx.config.smoke, seed=ctx.config.seed, tok=ctx.tok,
                      model_cfg=ctx.model_cfg, policies=ctx.policies)


def data_inputs(ctx: Run) -> data.Inputs:
  """The data stage's inputs: its config block, the grid and its record domains, where the
  datasets go."""
  c = ctx.config
  return data.Inputs(cfg=c.data, seed=c.seed, grid=ctx.grid, record_domains=tuple(c.records),
                     data_dir=ctx.data_dir, data=ctx.data,
                     check_references=c.sft.steps > 0 and "sft" in c.stages, files=ctx.files)


def sft_inputs(ctx: Run) -> sft.Inputs:
  """The sft stage's inputs: its config block, the tokenizer and view, the data streams, the
  initial policy, files and loops."""
  return sft.Inputs(
      cfg=ctx.config.sft, seed=ctx.config.seed, outside=ctx.config.outside,
      log_every=ctx.config.log_every, grid=ctx.grid, view=ctx.view, tok=ctx.tok,
      model_cfg=ctx.model_cfg, mesh=ctx.mesh, data=ctx.data, policies=ctx.policies,
      source=ctx.config.model.hf_path, files=ctx.files,
      loops=ctx.loops)


def rl_inputs(ctx: Run) -> rl.Inputs:
  """The rl stage's (and each lane worker's) inputs: its config blocks, the student's
  samplers, the tasks and data, files and loops."""
  c = ctx.config
  return rl.Inputs(
      cfg=c.rl, budget=c.budget, seed=c.seed, outside=c.outside, rollout_width=c.rollout.width,
      config_hash=c.hash, config_json=c.to_json(indent=1), grid=ctx.grid, view=ctx.view,
      model_cfg=ctx.model_cfg, mesh=ctx.mesh, teacher_hf_paths=ctx.teachers.hf_paths,
      teacher_tokenizers=ctx.teachers.tokenizer_records(),
      tasks={d: ctx.task(d) for d in ctx.grid.domains}, engine=ctx.engines.student,
      eval_engine=ctx.engines.eval, data=ctx.data, policies=ctx.policies, files=ctx.files,
      loops=ctx.loops)


def mopd_inputs(ctx: Run) -> mopd.Inputs:
  """The mopd stage's inputs: its config block, the student's and the teachers' samplers,
  the teachers (loaded once onto their mesh) and their scorer, the data streams, files and
  loops."""
  c, grid = ctx.config.mopd, ctx.grid
  served = bool(ctx.config.teacher.endpoints)
  colocated = ctx.config.placement.teachers == "colocated"
  kind = loss_kinds.LOSS_KINDS[c.loss]
  top_k = c.loss_args.k if kind.topk and not kind.char_targets else 0
  mixed = ctx.teachers.mixed  # checked before any teacher's params are read
  fams = [list(f.cells) for f in ctx.teachers.families]
  wrong = ([f"mopd.loss={c.loss!r}"] if (kind.topk and not kind.char_targets)
           or kind.teachers_in_step else [])
  wrong += [f"mopd.init_target={c.init_target!r}"] if c.init_target == "distribution" else []
  if mixed and wrong:
    raise config_mod.ConfigError(
        f"teachers of several families ({len(fams)} banks: {fams}) return the sampled "
        f"tokens' log-probs only; {' and '.join(wrong)} compare"
        f"{'s' if len(wrong) == 1 else ''} next-token distributions in one bank: use "
        "mopd.loss='mopd' and mopd.init_target='tokens'")
  if kind.char_targets and not any(f.cross for f in ctx.teachers.families):
    raise config_mod.ConfigError(
        f"mopd.loss={c.loss!r} reads teachers of another tokenizer; the teachers' tokenizer "
        "reads as the student's own: use mopd.loss='vocab_kl'")
  if kind.char_targets:
    try:
      for f in ctx.teachers.families:
        char_marginal.table_for(ctx.tok, f.tok)
    except char_marginal.NotCharacterLevel as e:
      raise config_mod.ConfigError(str(e)) from None
  # With teacher servers this process reads the teachers' params only for what runs here:
  # the teacher-SFT init's rollouts and the exact-KL diagnostic.
  if served and c.init != "teacher_sft" and not (c.exact_kl_every and colocated):
    bank = ctx.teachers.router_only()
  else:
    bank = ctx.teachers.load_bank()
  if mixed:
    print(f"[teachers] {len(bank.families)} teacher families, a bank each: " + "; ".join(
        f"{', '.join(f.cells)} ({'tokenizer ' + f.path if f.cross else 'the student tokenizer'},"
        f" {f.model_cfg.family} d_model {f.model_cfg.d_model})" for f in bank.families))
  scoring, scorer, monitor = teacher_scorer(ctx, bank, top_k=top_k)
  # char_kl with servers: their top-k, through clients of its own.
  char_source = served_char_source(ctx, scoring) if kind.char_targets and served else None
  teacher_engine = None if mixed else ctx.engines.teacher(ctx.teachers.model_cfg,
                                                          c.teacher_temperature)
  return mopd.Inputs(
      cfg=c, sft=ctx.config.sft, seed=ctx.config.seed, grid=grid, view=ctx.view, tok=ctx.tok,
      teacher_tok=step_tokenizers(ctx, bank), span_reward=ctx.config.teacher.span_reward,
      model_cfg=ctx.model_cfg, mesh=ctx.mesh, tasks={d: ctx.task(d) for d in grid.domains},
      engine=ctx.engines.student, teacher_engine=teacher_engine,
      teacher_engines=tuple(ctx.engines.teacher(f.model_cfg, c.teacher_temperature, f.tok)
                            for f in bank.families) if mixed else (),
      bank=bank, scoring=scoring, scorer=scorer, colocated=colocated, data=ctx.data,
      policies=ctx.policies, files=ctx.files, loops=ctx.loops, parity_monitor=monitor,
      char_source=char_source)


def scoring_bank(ctx: Run, bank: teachers.TeacherBank) -> teachers.TeacherBank:
  """The bank at `mopd.teacher_temperature`: the teachers score at it, and sample the
  teacher_sft init's trajectories at it, so the student is initialised on, and distilled
  from, the same distribution (a bank without params, the router alone, as it is)."""
  if families.is_mixed(bank):
    return bank.map_parts(lambda part: scoring_bank(ctx, part))
  return bank if not bank.params else bank.replace(
      params=models.with_temperature(bank.params, ctx.config.mopd.teacher_temperature))


def teacher_scorer(ctx: Run, bank: teachers.TeacherBank, *, top_k: int = 0) -> tuple:
  """(the bank at its scoring temperature, the scorer of stratified batches, the parity
  monitor or None) that MOPD and eval share: the `teacher.endpoints` servers' client,
  checked against the student and parity-probed at start, or the bank in this process
  (co-located or on its disaggregated slice)."""
  scoring = scoring_bank(ctx, bank)
  if ctx.config.teacher.endpoints:
    if ctx.teachers.mixed:
      check_served_families(ctx)
    scorer = served_client(ctx, scoring, top_k=top_k)
    return scoring, scorer, parity_probe(ctx, scoring, scorer)
  # Co-located or disaggregated: log-probs come back on the student mesh.
  if families.is_mixed(scoring):  # a bank per family, each scoring its teachers' rows
    return scoring, families.MixedScorer(scoring, ctx.mesh, ctx.teacher_mesh), None
  return (scoring, placement.TeacherScorer(scoring, ctx.mesh, ctx.teacher_mesh, top_k=top_k),
          None)


def served_client(ctx: Run, scoring, *, top_k: int, family=None, extra_tokens: int = 0):
  """The `teacher.endpoints` servers' client (of `family`'s cells alone when given), each
  server checked against its family's vocabulary, tokenizer, scoring temperature and
  longest row (plus `extra_tokens`), and against a scoring request at `top_k`."""
  try:
    api_key = ctx.config.teacher.api_key()
  except ValueError as e:
    raise config_mod.ConfigError(str(e)) from e
  fams = ctx.teachers.families if family is None else (family,)
  against = [{"vocab_size": f.model_cfg.vocab_size, "tokenizer": f.tok,
              "temperature": ctx.config.mopd.teacher_temperature,
              "max_len": longest_row(ctx, f.tok) + extra_tokens,
              **({"whose": "the run's teachers'"} if f.cross else {}),
              **({"cells": f.cells} if ctx.teachers.mixed else {})}
             for f in fams]
  return mopd.endpoint_scorer(
      ctx.grid.names if family is None else family.cells, ctx.config.teacher.endpoints,
      policy=ctx.config.teacher.retry_policy(), top_k=top_k,
      student=against if len(against) > 1 else against[0], api_key=api_key,
      parity=bool(scoring.params))


def served_char_source(ctx: Run, scoring) -> char_served.Served:
  """Served teachers read for the `char_kl` targets: a client per family asking for the top
  `teacher.served_top_k` (at most the family's vocabulary) at every position. Its requests
  give the steps' eq. 15 scores too (the MOPD stage scores through it, not `scorer`)."""
  k = ctx.config.teacher.served_top_k
  return char_served.Served(scoring, tuple(
      (f.cells, served_client(ctx, scoring, top_k=min(k, f.model_cfg.vocab_size), family=f,
                              extra_tokens=1))
      for f in ctx.teachers.families))


def check_served_families(ctx: Run) -> None:
  """Teachers of several families served: a server holds one tokenizer, so one URL serving
  cells of two families is a config error naming both."""
  family = {c: i for i, f in enumerate(ctx.teachers.families) for c in f.cells}
  served = {}
  for cell, urls in ctx.config.teacher.endpoints.items():
    for url in urls:
      served.setdefault(url, set()).add(cell)
  for url, cells in served.items():
    if len({family[c] for c in cells}) > 1:
      raise config_mod.ConfigError(
          f"teacher server {url} serves {sorted(cells)}, cells of teachers of different "
          "families (teacher.tokenizer_paths); a server holds one tokenizer")


# {run: {id(tokenizer): its longest row}}: measured once per run and tokenizer (the servers'
# clients of a run, eq. 15's and `char_kl`'s per family, each check it, and it encodes every
# prompt of every split at every effort), and forgotten with the run.
_LONGEST_ROWS = weakref.WeakKeyDictionary()


def longest_row(ctx: Run, tok=None) -> int:
  """The longest row the run can send a teacher of tokenizer `tok` (default the teachers'):
  its grid's longest prompt (every split, the student's view at every effort, the longer
  one; teachers of another tokenizer: their own prompt) plus the rollout's response cap,
  counted in the student's tokens (a teacher of another tokenizer that writes a response in
  more tokens than the student can exceed it; its server then refuses that row by name)."""
  tok = ctx.teacher_tok if tok is None else tok
  known = _LONGEST_ROWS.setdefault(ctx, {})
  if id(tok) not in known:
    known[id(tok)] = _longest_prompt(ctx, tok) + ctx.config.rollout.max_response_tokens
  return known[id(tok)]


def _longest_prompt(ctx: Run, tok) -> int:
  """The grid's longest prompt in `tok`'s tokens, every split, at every effort."""
  shown = ctx.view.teacher if tok is not ctx.tok else ctx.view.student
  longest = 0
  for d in ctx.grid.domains:
    for split in ("train", "validation", "test"):
      source = ctx.data.split(d, split)
      for i in range(len(source)):
        prompt = source[i].prompt
        longest = max(longest, *(len(tok.encode_prompt(prompt, shown(e)))
                                 for e in ctx.grid.effort_names))
  return longest


def parity_probe_set(ctx: Run, *, rows: int, max_len: int = 0):
  """The parity probe's set: the first `rows` validation examples of each cell's domain, as
  the cell's teacher sees them (`parity.probe_from_examples`), cut to `max_len` tokens."""
  rendered = {}
  for f in ctx.teachers.families:  # each cell's rows in its teacher's tokens
    examples = {}
    for cell in f.cells:
      val = ctx.data.split(cell.split("/", 1)[0], "validation")
      examples[cell] = [val[i] for i in range(min(rows, len(val)))]
    rendered.update(parity.probe_from_examples(examples, tok=f.tok, view=ctx.view,
                                               max_len=max_len).rows)
  return source.Probe.of({c: rendered[c] for c in ctx.grid.names})


def parity_probe(ctx: Run, scoring: teachers.TeacherBank, scorer, *,
                 rows: int = 4) -> parity.Monitor:
  """The parity probe at start (mopd_jax/teachers/parity.py): every replica of every cell
  scores the first `rows` validation examples of the cell's domain, compared with the
  in-process `scoring` bank where the run holds the teachers' params, else with the cell's
  first replica (replicas must agree). The gaps go to <workdir>/teacher_parity.json;
  ConfigError (the servers closed) when one exceeds the tolerance (`teacher.tolerance()`).
  Returns the monitor that probes again every `teacher.probe_every` MOPD steps."""
  local = None
  longest = [scorer.info().max_sequence]
  if scoring.params and families.is_mixed(scoring):
    local = families.MixedScorer(scoring, ctx.mesh, ctx.teacher_mesh)
    longest.append(local.info().max_sequence)
  elif scoring.params:
    local = placement.TeacherScorer(scoring, ctx.mesh, ctx.teacher_mesh,
                                    tokenizer_hash=tokenizer.fingerprint(ctx.teacher_tok))
    longest.append(local.info().max_sequence)
  probe = parity_probe_set(ctx, rows=rows, max_len=min((n for n in longest if n), default=0))
  replicas = scorer.score_probe_replicas(probe)
  if local is not None:
    reference, against = local.score_probe(probe), "the run's own teachers"
  else:
    reference = {cell: replicas[(cell, scorer.endpoints[cell][0])] for cell in probe.rows}
    against = "each cell's first replica"
  tol = ctx.config.teacher.tolerance()
  monitor = parity.Monitor(probe, reference, tolerance=tol,
                           every=ctx.config.teacher.probe_every)
  measured = monitor.gaps_of(replicas)
  print(f"[teachers] parity probe against {against} ({len(probe.rows)} cells, {rows} rows "
        f"each): largest gap {max(measured.values()):.3g} nats per token (tolerance {tol})")
  if distributed.is_main():
    checkpoint.write_json(ctx.path("teacher_parity.json"),
                          {"tolerance": tol, "against": against, "gaps": measured})
  try:
    parity.check(measured, tol, what=f"teacher.endpoints={ctx.config.teacher.endpoints!r}")
  except ValueError as e:
    scorer.close()
    raise config_mod.ConfigError(str(e)) from e
  return monitor


def eval_inputs(ctx: Run) -> eval_stage.Inputs:
  """The eval stage's inputs: its config block, the models' configs, the tasks and test
  splits, the engines and the loaders of the policies."""
  ec = ctx.config.eval
  scorer, cells, bank, kl_setup, kl_scoring = None, (), None, None, None
  # The held-out KL reads the teachers' params beside the student's, in this process: the
  # exact KL over one vocabulary, or for teachers of another tokenizer the sampled sequence
  # log-ratio (`agreement.logratio_rows`).
  cross = ctx.teacher_tok is not ctx.tok or ctx.teachers.mixed
  kl = ec.kl_rollouts > 0 and ctx.config.placement.teachers == "colocated"
  if ec.kl_rollouts and not kl:
    print("[eval] eval.kl_rollouts: the held-out KL needs co-located teachers; not measured")
  if ec.teacher_logratio and cross:
    why = ("teachers of several families (teacher.tokenizer_paths, or model shapes)"
           if ctx.teachers.mixed else "teachers of another tokenizer (teacher.tokenizer_path)")
    raise config_mod.ConfigError("eval.teacher_logratio scores pi_SFT's and the student's "
                                 f"tokens; {why} need eval.teacher_logratio=False")
  if ec.teacher_logratio or kl:
    bank = (ctx.teachers.router_only() if ctx.config.teacher.endpoints and not kl
            else ctx.teachers.load_bank())
  if ec.teacher_logratio:  # scored as the MOPD stage scores
    scorer = teacher_scorer(ctx, bank)[1]
    cells = tuple(bank.router.names)
  if kl:
    kl_scoring = scoring_bank(ctx, bank)
    kl_setup = mopd_lib.StepSetup(bank, ctx.engines.student,
                                  {d: ctx.task(d) for d in ctx.grid.domains},
                                  ctx.grid.cells, ctx.grid.taus, view=ctx.view,
                                  teacher_tok=step_tokenizers(ctx, bank) if cross else None)
  return eval_stage.Inputs(
      scorer=scorer, teacher_cells=cells, kl_setup=kl_setup, kl_scoring=kl_scoring,
      cfg=ctx.config.eval, grid=ctx.grid, view=ctx.view, model_cfg=ctx.model_cfg,
      tasks={d: ctx.task(d) for d in ctx.grid.domains},
      data=ctx.data, engines=ctx.engines, policies=ctx.policies, teachers=ctx.teachers,
      files=ctx.files, loops=ctx.loops)


def step_tokenizers(ctx: Run, bank):
  """What `StepSetup.teacher_tok` (and the mopd stage's `teacher_tok`) takes: the teachers'
  tokenizer, or with several families each teacher's (router order; their rows then take
  the path of another tokenizer, which on a family of the student's tokenizer aligns each
  token with itself)."""
  return bank.tokenizers() if families.is_mixed(bank) else ctx.teacher_tok


def report_inputs(ctx: Run) -> report.Inputs:
  """The report stage's inputs: the resolved config it records, the grid, the files."""
  return report.Inputs(config_json=ctx.config.to_json(), grid=ctx.grid, files=ctx.files)


# The stage registry, in pipeline order: each entry runs its stage on the run.
STAGES = {"smoke": lambda ctx: smoke.run(smoke_inputs(ctx)),
          "data": lambda ctx: data.run(data_inputs(ctx)),
          "sft": lambda ctx: sft.run(sft_inputs(ctx)),
          "rl": lambda ctx: rl.run(rl_inputs(ctx)),
          "mopd": lambda ctx: mopd.run(mopd_inputs(ctx)),
          "eval": lambda ctx: eval_stage.run(eval_inputs(ctx)),
          "report": lambda ctx: report.run(report_inputs(ctx))}
