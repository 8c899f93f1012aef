"""The pipeline: stages chained in order, each a library function of a `Run` context.

    data -> sft -> rl (3 domains x 3 efforts = 9 teachers) -> mopd (student) -> eval -> report

Every stage writes its outputs under the workdir and a `DONE.json` marker last; re-running
with the same workdir skips finished stages, and `--config.stages=rl,eval` runs a subset
reusing earlier outputs. Layout:

    <workdir>/data/                    TFDS array_record datasets
    <workdir>/sft/params/              pi_SFT (orbax)
    <workdir>/rl/<domain>/teacher_<e>/ the frozen teachers (orbax), one lane per domain
    <workdir>/teachers.json            the teacher manifest
    <workdir>/mopd/params/             the student (orbax); mopd/history.json its curves
    <workdir>/eval.json                test-split cells of pi_SFT, every teacher, the student
    <workdir>/report.json, report.md, *.png
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Optional, Sequence

import jax
import ml_collections
import numpy as np

from mopd_jax import (async_scoring, checkpoint, distributed, metrics, models, mopd,
                      placement, rl, rollout, sampling, sft, sharding, teachers, train)
from mopd_jax import lanes as lanes_mod
from mopd_jax.tasks import DOMAINS, base as task_base, get_task
from mopd_jax.tokenizer import EFFORTS, load_tokenizer

STAGES = ("smoke", "data", "sft", "rl", "mopd", "eval", "report")


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> models.ModelConfig:
  """The student's ModelConfig: a preset with overrides, or a Hugging Face checkpoint's."""
  from mopd_jax import hf
  return hf.resolve_model_config(config.model, vocab_size)


def config_hash(config: ml_collections.ConfigDict) -> str:
  return hashlib.sha256(config.to_json(sort_keys=True).encode()).hexdigest()[:16]


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Clear errors before anything compiles (`raise`, never `assert`: python -O keeps them)."""
  mesh = dict(config.mesh)
  prod = placement.num_devices(config)  # + the teachers' sub-mesh when disaggregated
  if prod != num_devices:
    raise ValueError(f"mesh {mesh} (with the teacher placement {config.get('placement')}) "
                     f"has {prod} devices but {num_devices} are available")
  e = config.effort
  if not e.tau_max > e.tau_high > e.tau_low > 0:
    raise ValueError(f"effort taus must be strictly ordered max > high > low > 0, got "
                     f"max={e.tau_max}, high={e.tau_high}, low={e.tau_low}")
  t = config.mopd.get("teacher_temperature", 1.0)
  if not (isinstance(t, (int, float)) and t > 0):
    raise ValueError(f"mopd.teacher_temperature must be > 0, got {t!r}")
  if not config.mopd.r_max > 0:
    raise ValueError(f"mopd.r_max must be > 0, got {config.mopd.r_max}")
  data_par = mesh.get("data", 1) * mesh.get("fsdp", 1)
  batches = {"sft.batch_size": config.sft.batch_size,
             "rl.prompts_per_step * rl.group_size": config.rl.prompts_per_step *
             config.rl.group_size,
             "mopd batch (9 cells * mopd.prompts_per_cell)": 9 * config.mopd.prompts_per_cell}
  for name, size in batches.items():
    if size <= 0 or size % data_par:
      raise ValueError(f"{name} = {size} is not a positive multiple of the data x fsdp mesh "
                       f"size {data_par}")
  if config.mopd.loss not in ("mopd", "pg", "topk"):
    raise ValueError(f"mopd.loss={config.mopd.loss!r}; expected 'mopd', 'pg' or 'topk'")
  if not config.mopd.get("alpha", 0.0) >= 0:
    raise ValueError(f"mopd.alpha must be >= 0 (weight of the outcome-reward term), got "
                     f"{config.mopd.alpha}")
  top_k = config.mopd.get("top_k", 8)
  if config.mopd.loss == "topk" and not (isinstance(top_k, int) and top_k >= 1):
    raise ValueError(f"mopd.top_k must be a positive int with mopd.loss='topk', got {top_k!r}")
  staleness = config.mopd.get("staleness", 0)
  if staleness not in (0, 1):
    raise ValueError(f"mopd.staleness must be 0 (synchronous) or 1 (teachers one step "
                     f"behind), got {staleness!r}")
  bounds = tuple(config.mopd.get("is_bounds", (0.5, 2.0)))
  if staleness and not (len(bounds) == 2 and 0 <= bounds[0] <= 1 <= bounds[1]):
    raise ValueError(f"mopd.is_bounds must be (low, high) with 0 <= low <= 1 <= high, got "
                     f"{bounds}")
  if staleness and config.mopd.loss != "mopd":
    raise ValueError(f"mopd.staleness=1 weights the eq. 15 loss by truncated importance "
                     f"weights; it needs mopd.loss='mopd', got {config.mopd.loss!r}")
  if config.rl.loss not in ("pmd", "grpo"):
    raise ValueError(f"rl.loss={config.rl.loss!r}; expected 'pmd' or 'grpo'")
  refs = rl.references(config.rl.get("reference", "sampler"))  # raises on a bad spec
  if set(refs.values()) != {"sampler"} and config.rl.loss != "pmd":
    raise ValueError(f"rl.reference={config.rl.get('reference')!r} holds PMD's old policy "
                     f"fixed for an effort phase; it needs rl.loss='pmd', got "
                     f"{config.rl.loss!r}")
  for e in rl.EFFORT_ORDER:
    ph = rl.phase_settings(config.rl, e)
    if not (ph["lr"] > 0 and ph["tau_kl"] > 0 and isinstance(ph["steps"], int)
            and ph["steps"] >= 1):
      raise ValueError(f"rl: the {e} phase needs lr > 0, tau_kl > 0 and steps >= 1, got {ph}")
  outside_teacher(config)  # raises on a bad outside-teacher ablation
  sft_schedule(config)
  sft_style_weights(config)
  if not config.sft.get("weight_decay", 0.0) >= 0:
    raise ValueError(f"sft.weight_decay must be >= 0, got {config.sft.weight_decay}")
  _prompts_across_efforts(config.mopd)
  lanes_mod.process_count(config.rl, 1)  # raises on a bad rl.lane_processes
  every = checkpoint_every(config)
  if not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
    raise ValueError(f"checkpoint.every must be a positive int (steps between saves), got "
                     f"{every!r}")


def checkpoint_every(config: ml_collections.ConfigDict) -> int:
  """Steps between per-step checkpoints (`checkpoint.every`; every step when absent)."""
  block = config.get("checkpoint")
  return block.get("every", 1) if block is not None else 1


class Run:
  """What every stage needs: config, workdir, tokenizer, model config, mesh, budgets."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    validate_config(config, jax.device_count())
    self.config = config
    self.workdir = os.path.abspath(workdir)
    from mopd_jax import profiling
    profiling.configure(config.get("profile"), self.workdir)  # raises on a bad switch
    self.tok = load_tokenizer(config.model.get("tokenizer_path") or "char")
    self.model_cfg = model_config(config, self.tok.vocab_size)
    # The student's mesh, and the teachers' (the same one unless disaggregated).
    self.mesh, self.teacher_mesh = placement.config_meshes(config)
    self.taus = {"max": config.effort.tau_max, "high": config.effort.tau_high,
                 "low": config.effort.tau_low}
    self.data_dir = config.data.dir or os.path.join(self.workdir, "data")

  def path(self, *parts) -> str:
    return os.path.join(self.workdir, *parts)

  def done(self, stage: str) -> bool:
    return os.path.exists(self.path(stage, "DONE.json"))

  def mark_done(self, stage: str, info: dict) -> None:
    os.makedirs(self.path(stage), exist_ok=True)
    checkpoint.write_json(self.path(stage, "DONE.json"), info)

  @functools.lru_cache(maxsize=None)
  def make_engine(self, model_cfg: models.ModelConfig,
                  temperature: float) -> rollout.RolloutEngine:
    """One rollout engine (and its compiled sampler) per (model, temperature)."""
    c = self.config.rollout
    return rollout.RolloutEngine(model_cfg, self.tok, max_response_tokens=c.max_response_tokens,
                                 temperature=temperature, max_turns=c.max_turns)

  @property
  def engine(self) -> rollout.RolloutEngine:
    """The student's sampling engine (RL and MOPD rollouts)."""
    return self.make_engine(self.model_cfg, self.config.rl.temperature)

  @property
  def eval_engine(self) -> rollout.RolloutEngine:
    return self.make_engine(self.model_cfg, self.config.eval.temperature)

  def split(self, domain: str, split: str):
    from mopd_jax.tasks import datasets
    return datasets.load_split(domain, split, self.data_dir, seed=self.config.seed,
                               sizes=tuple(self.config.data.sizes))

  def iterator(self, domain: str, batch_size: int, salt: int, seed: Optional[int] = None):
    """Training batches; `seed` (default: the run's) sets the data order, not the data."""
    from mopd_jax.tasks import datasets
    seed = self.config.seed if seed is None else seed
    return datasets.ResumableIterator(self.split(domain, "train"), batch_size,
                                      seed=seed * 1000 + salt)

  @property
  def teacher_hf_paths(self) -> tuple:
    t = self.config.get("teacher")
    return tuple(t.hf_paths) if t is not None and t.get("hf_paths") else ()

  @functools.cached_property
  def teacher_cfg(self) -> models.ModelConfig:
    """Teachers trained by the rl stage share the student's shape; teachers brought as
    Hugging Face checkpoints (`teacher.hf_paths`) have their own (e.g. Qwen3-1.7B)."""
    if not self.teacher_hf_paths:
      return self.model_cfg
    from mopd_jax import hf
    cfg = hf.resolve_model_config(self.config.teacher, self.tok.vocab_size,
                                  hf_path=self.teacher_hf_paths[0])
    teachers.check_compatible(self.model_cfg, cfg)
    return cfg

  def teacher_engine(self, sampling: bool = False) -> rollout.RolloutEngine:
    """Rollouts of a teacher: greedy for evaluation, or at the RL temperature."""
    c = self.config
    return self.make_engine(self.teacher_cfg,
                            c.rl.temperature if sampling else c.eval.temperature)

  def load_teacher(self, entry: dict):
    if entry.get("format") == "hf":
      from mopd_jax import hf
      _, params = hf.load_checkpoint(entry["path"])
      return params
    return checkpoint.load_params(entry["path"], self.params_like())

  def train_loop(self, name: str, directory: str, total_steps: int,
                 data_state=dict) -> checkpoint.TrainLoop:
    """Per-step checkpoints of one training loop under `directory` (see checkpoint.py)."""
    return checkpoint.TrainLoop(name, directory, every=checkpoint_every(self.config),
                                total_steps=total_steps, data_state=data_state,
                                skip_nonfinite=bool(self.config.get("skip_nonfinite", False)))

  def logger(self, stage: str) -> metrics.MetricsLogger:
    return metrics.MetricsLogger(self.path("tb", stage))

  def params_like(self):
    """Shapes, dtypes and the student mesh's shardings of the params: the target every
    checkpoint restores onto (each process reads only its own shards)."""
    shapes = jax.eval_shape(lambda: models.init_params(self.model_cfg, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, sharding.param_shardings(self.model_cfg, self.mesh))


class Progress:
  """A progress line per stage with rate and ETA (tqdm when stderr is a terminal-like sink)."""

  def __init__(self, name: str, total: int, initial: int = 0):
    from tqdm.auto import tqdm

    from mopd_jax import profiling
    # Every process runs the same loop; only process 0 draws the bar (like MetricsLogger).
    self.bar = tqdm(total=total, initial=initial, desc=name, unit="step", dynamic_ncols=True,
                    mininterval=1.0, disable=jax.process_index() != 0)
    # The bar counts the loop's steps, so it is also where `config.profile` traces a range.
    self.profiler = profiling.for_stage(name, initial)

  def update(self, metrics: dict, keys=("loss", "reward", "length", "accuracy")):
    self.bar.set_postfix({k: f"{metrics[k]:.3f}" for k in keys if k in metrics}, refresh=False)
    self.bar.update(1)
    if self.profiler is not None:
      self.profiler.after_step()

  def close(self):
    self.bar.close()
    if self.profiler is not None:
      self.profiler.close()


def width_for(trajs_or_len, multiple: int = 16, cap: Optional[int] = None) -> int:
  n = trajs_or_len if isinstance(trajs_or_len, int) else max(
      len(t.prompt_ids) + len(t.ids) for t in trajs_or_len)
  w = -(-n // multiple) * multiple
  return w if cap is None else min(w, max(cap, n))


# ----------------------------------------------------------------------------- stages


def initial_params(run: Run, seed: Optional[int] = None):
  """The policy SFT starts from: a Hugging Face checkpoint (`model.hf_path`) or a fresh init
  (from `seed`, default the run's)."""
  hf_path = run.config.model.get("hf_path")
  if hf_path:
    from mopd_jax import hf
    _, params = hf.load_checkpoint(hf_path, sharding=sharding.param_shardings(run.model_cfg,
                                                                               run.mesh))
    return params
  return models.init_params(run.model_cfg, jax.random.PRNGKey(
      run.config.seed if seed is None else seed),
      out_shardings=sharding.param_shardings(run.model_cfg, run.mesh))


def smoke(run: Run) -> list:
  """Sample from a freshly initialised model and print the samples."""
  c, tok = run.config, run.tok
  params = initial_params(run)
  prompts = [[tok.bos_id] + tok.encode(p) for p in c.smoke.prompts]
  scfg = sampling.SamplingConfig(max_new_tokens=c.smoke.max_new_tokens,
                                 stop_tokens=(tok.eos_id,), pad_id=tok.pad_id)
  rollout_ = sampling.sample(run.model_cfg, params, prompts, jax.random.PRNGKey(c.seed + 1), scfg)
  texts = []
  for b, prompt in enumerate(c.smoke.prompts):
    gen = [int(t) for t, m in zip(rollout_.tokens[b], rollout_.loss_mask[b]) if m]
    texts.append(tok.decode(gen))
    print(f"[{b}] prompt={prompt!r}\n    sample={texts[-1]!r}  "
          f"({int(rollout_.lengths[b])} tokens, stopped={bool(rollout_.stopped[b])})")
  return texts


def data(run: Run) -> None:
  from mopd_jax.tasks import datasets
  if distributed.is_main():  # one writer; the others read the files after the stage's sync
    for d in DOMAINS:
      datasets.prepare(d, run.data_dir, seed=run.config.seed,
                       sizes=tuple(run.config.data.sizes))
  run.mark_done("data", {"domains": list(DOMAINS), "sizes": list(run.config.data.sizes)})


def outside_teacher(config: ml_collections.ConfigDict) -> tuple:
  """(cell, seed) of the outside-teacher ablation (`teacher.outside_cell`, e.g. "gen/max":
  that cell's teacher is trained from a second SFT of seed `teacher.outside_seed`), or
  (None, None) when the ablation is off."""
  t = config.get("teacher")
  cell = t.get("outside_cell") if t is not None else None
  if not cell:
    return None, None
  if cell not in teachers.DEFAULT_NAMES:
    raise ValueError(f"teacher.outside_cell={cell!r} is not a teacher cell; expected one of "
                     f"{teachers.DEFAULT_NAMES}")
  if t.get("hf_paths"):
    raise ValueError("teacher.outside_cell needs teachers trained by the rl stage; it cannot "
                     "be combined with teacher.hf_paths")
  seed = t.get("outside_seed")
  if not isinstance(seed, int) or seed == config.seed:
    raise ValueError(f"teacher.outside_seed={seed!r} must be an int other than the run's "
                     f"seed {config.seed} (the outside SFT needs its own init and order)")
  return cell, int(seed)


def sft_stage(run: Run) -> None:
  """pi_SFT: round-robin over domains, one domain per update (each batch padded to its own
  length), QAT from here on. With `teacher.outside_cell` set, also the outside SFT (its own
  seed: init, data order and effort tokens differ) under sft/outside/."""
  t0 = time.time()
  state, history = _train_sft(run, run.config.seed, "sft", run.path("sft"))
  checkpoint.save_params(run.path("sft", "params"), state.params)
  info = {"steps": run.config.sft.steps, "final_loss": history[-1][1],
          "seconds": time.time() - t0, "loss_curve": history}
  cell, seed = outside_teacher(run.config)
  if cell:
    out = run.path("sft", "outside", "params")
    state, hist = _train_sft(run, seed, "sft outside", run.path("sft", "outside"))
    checkpoint.save_params(out, state.params)
    info["outside"] = {"cell": cell, "seed": seed, "final_loss": hist[-1][1],
                       "loss_curve": hist}
  run.mark_done("sft", info)


def _train_sft(run: Run, seed: int, name: str, directory: str):
  """One SFT run of `seed` (init, data order, batch rng), checkpointed under `directory`;
  returns (state, loss history)."""
  c = run.config.sft
  trainer = train.Trainer(run.model_cfg, train.LossConfig(kind="sft"),
                          train.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps,
                                            total_steps=c.steps,
                                            weight_decay=c.get("weight_decay", 0.0),
                                            microbatches=c.get("microbatches", 1)), run.mesh)
  iters = {d: run.iterator(d, c.batch_size, salt=i, seed=seed) for i, d in enumerate(DOMAINS)}
  schedule = sft_schedule(run.config)
  log = run.logger(name.replace(" ", "_"))
  data_state = lambda: {d: it.state() for d, it in iters.items()}
  with run.train_loop(name, os.path.join(directory, "ckpt"), c.steps, data_state) as loop:
    state = loop.restore(trainer.abstract_state(run.params_like()))
    if state is None:
      state = trainer.init(initial_params(run, seed))
    else:  # continue the data streams exactly where the checkpoint left them
      for d, pos in loop.data.items():
        iters[d].restore(pos)
    bar = Progress(name, c.steps, initial=loop.start_step)

    def log_step(step, m):
      bar.update(m)
      if step % run.config.log_every == 0 or step == c.steps - 1:
        log.scalars(step, m)

    state, history = sft.train_sft(
        trainer, state, run.tok, lambda step: next(iters[schedule[step % len(schedule)]]),
        steps=c.steps, effort_mode=c.effort_mode, seed=seed, log=log_step,
        # each batch padded to its own length (one domain per update)
        width=lambda exs: width_for(max(len(rollout.encode_prompt(run.tok, ex, "max")) +
                                        len(run.tok.encode(ex.solutions["full"])) + 1
                                        for ex in exs)),
        loop=loop, style_weights=sft_style_weights(run.config))
  bar.close()
  log.close()
  return state, history


def sft_style_weights(config: ml_collections.ConfigDict) -> dict:
  """`sft.style_weights` as {domain: (w_full, w_brief, w_direct)}; a domain it does not name
  draws its styles uniformly."""
  spec = config.sft.get("style_weights", None) or {}
  weights = {d: tuple(float(x) for x in w) for d, w in dict(spec).items()}
  unknown = sorted(set(weights) - set(DOMAINS))
  if unknown:
    raise ValueError(f"sft.style_weights names unknown domains {unknown}; known: "
                     f"{list(DOMAINS)}")
  for w in weights.values():
    sft.style_probs(w, task_base.STYLES)  # raises on a bad tuple
  return weights


def sft_schedule(config: ml_collections.ConfigDict) -> list:
  """The repeating sequence of domains SFT trains on, one per update (`sft.schedule`, e.g.
  "gen,agt,agt,cod,cod" gives the longer traces twice the updates; empty = round-robin)."""
  spec = config.sft.get("schedule", "") or ",".join(DOMAINS)
  schedule = [d.strip() for d in spec.split(",") if d.strip()]
  unknown = sorted(set(schedule) - set(DOMAINS))
  if unknown or set(schedule) != set(DOMAINS):
    raise ValueError(f"sft.schedule={spec!r} must name every domain of {list(DOMAINS)} and "
                     f"nothing else{f' (unknown: {unknown})' if unknown else ''}")
  return schedule


def _eval_budgets(run: Run, examples, effort):
  return [task_base.budget(ex, run.taus[effort]) for ex in examples]


def rl_stage(run: Run) -> None:
  """Three independent lanes (one per domain) of the effort anneal max -> high -> low, one
  after another in this process or side by side in their own (`rl.lane_processes`)."""
  c = run.config.rl
  manifest = checkpoint.read_json(run.path("teachers.json"), default={"teachers": {}})
  if run.teacher_hf_paths:  # teachers brought as checkpoints: register, do not train
    if len(run.teacher_hf_paths) != len(teachers.DEFAULT_NAMES):
      raise ValueError(f"teacher.hf_paths has {len(run.teacher_hf_paths)} entries; expected "
                       f"{len(teachers.DEFAULT_NAMES)} in the order {teachers.DEFAULT_NAMES}")
    for name, path in zip(teachers.DEFAULT_NAMES, run.teacher_hf_paths):
      if not os.path.isdir(path):
        raise FileNotFoundError(f"teacher {name}: no checkpoint directory {path}")
      d, e = name.split("/")
      manifest["teachers"][name] = {"domain": d, "effort": e, "tau": run.taus[e], "step": 0,
                                    "parent": path, "path": path, "format": "hf",
                                    "config_hash": config_hash(run.config),
                                    "eval_validation": None}
    checkpoint.write_json(run.path("teachers.json"), manifest)
    run.mark_done("rl", {"teachers": sorted(manifest["teachers"]), "source": "hf"})
    return
  lanes = rl_lanes(run)
  processes = lanes_mod.process_count(c, len(lanes))
  if processes > 1:
    # Each lane process keeps its records in its lane directory; they join the manifest here.
    lanes_mod.run_side_by_side(run, lanes, processes)
    for lane in lanes:
      manifest.setdefault(lane.section, {}).update(lanes_mod.read_records(lane))
  else:
    trainers = {}
    for lane in lanes:
      section = manifest.setdefault(lane.section, {})
      run_lane(run, lane, section, lambda: checkpoint.write_json(run.path("teachers.json"),
                                                                 manifest), trainers)
  cell, outside_seed = outside_teacher(run.config)
  if cell:
    # Route the cell to the outside teacher; the same-origin one it replaces stays on record.
    # Without its data_state: a restarted same-origin lane restores its own stream from
    # `teachers`, and the outside lane's stream is not it.
    if manifest["teachers"][cell].get("origin") != "outside":
      manifest.setdefault("same_origin", {})[cell] = manifest["teachers"][cell]
    manifest["teachers"][cell] = {
        **{k: v for k, v in manifest["outside"][cell].items() if k != "data_state"},
        "origin": "outside", "sft_seed": outside_seed}
  checkpoint.write_json(run.path("teachers.json"), manifest)
  run.mark_done("rl", {"teachers": sorted(manifest["teachers"]),
                      **({"outside_cell": cell} if cell else {})})
  print(teacher_table(manifest))


@dataclasses.dataclass(frozen=True)
class Lane:
  """One RL lane: a domain's effort anneal from `parent`, its own directory and data stream.

  `section`: the manifest section its teachers are recorded in ("teachers", or "outside"
  for the outside teacher's lane); `tag` prefixes its progress and log names."""
  domain: str
  parent: str
  directory: str
  efforts: tuple
  section: str
  seed: int
  tag: str = ""

  @property
  def name(self) -> str:
    return f"{self.tag.replace(' ', '_')}{self.domain}"


def rl_lanes(run: Run) -> list:
  """The rl stage's lanes, in the order they run one after another."""
  lanes = [Lane(d, run.path("sft", "params"), run.path("rl", d), tuple(rl.EFFORT_ORDER),
                "teachers", run.config.seed) for d in DOMAINS]
  cell, outside_seed = outside_teacher(run.config)
  if cell:
    # The outside teacher goes through its cell's own anneal (max -> ... -> its effort), from
    # the outside SFT, in a lane of its own.
    d, e = cell.split("/")
    lanes.append(Lane(d, run.path("sft", "outside", "params"), run.path("rl_outside", d),
                      tuple(rl.EFFORT_ORDER[:rl.EFFORT_ORDER.index(e) + 1]), "outside",
                      outside_seed, "outside "))
  return lanes


def run_lane(run: Run, lane: Lane, record: dict, save, trainers: Optional[dict] = None,
             on_step=None) -> None:
  """Trains the lane's efforts not yet in `record` (its manifest section), adding each
  teacher's entry to `record` and calling `save()` after each. `trainers`: a cache shared by
  lanes run in one process (a Trainer holds configs and compiled steps, no state, so phases
  with the same settings share one, and so its compilations: several seconds each on a
  CPU). `on_step(effort, step, metrics)`: called after every RL step."""
  c = run.config.rl
  trainers = {} if trainers is None else trainers

  def trainer_for(ph):
    key = (ph["lr"], ph["tau_kl"], ph["steps"])
    if key not in trainers:
      loss_cfg = train.LossConfig(kind=c.loss, group_size=c.group_size, tau_kl=ph["tau_kl"],
                                  token_clip=c.token_clip or None)
      # A fresh optimizer per phase, its cosine over the phase's steps.
      trainers[key] = train.Trainer(
          run.model_cfg, loss_cfg,
          train.OptimConfig(lr=ph["lr"], warmup_steps=0, total_steps=ph["steps"],
                            microbatches=c.get("microbatches", 1)), run.mesh)
    return trainers[key]

  like = run.params_like()
  domain, tag, seed = lane.domain, lane.tag, lane.seed
  di = DOMAINS.index(domain)
  task = get_task(domain)
  os.makedirs(lane.directory, exist_ok=True)
  parent = lane.parent
  params = root = checkpoint.load_params(parent, like)
  it = run.iterator(domain, c.prompts_per_step, salt=100 + di, seed=seed)
  val = [run.split(domain, "validation")[i] for i in range(
      min(run.config.eval.num_examples, len(run.split(domain, "validation"))))]
  for effort in lane.efforts:
    name = f"{domain}/{effort}"
    out = os.path.join(lane.directory, f"teacher_{effort}")
    if name in record and os.path.exists(out):
      params, parent = checkpoint.load_params(out, like), out
      if "data_state" in record[name]:  # the next effort reads on from here
        it.restore(record[name]["data_state"])
      continue
    log = run.logger(f"rl_{lane.name}_{effort}")
    t0 = time.time()
    ph = rl.phase_settings(c, effort)
    trainer = trainer_for(ph)

    def log_step(step, m, bar=None, effort=effort):
      bar.update(m)
      log.scalars(step, m)
      if on_step is not None:
        on_step(effort, step, m)

    # One checkpoint directory per (domain, effort) run: lanes never share state.
    with run.train_loop(f"rl {tag}{name}", os.path.join(lane.directory, f"ckpt_{effort}"),
                        ph["steps"], lambda: {"train": it.state()}) as loop:
      state = loop.restore(trainer.abstract_state(like))
      if state is None:
        state = trainer.init(params)
      else:
        it.restore(loop.data["train"])
      bar = Progress(f"rl {tag}{name}", ph["steps"], initial=loop.start_step)
      state, hist = rl.run_effort(
          trainer, state, run.engine, task, lambda step: next(it), effort=effort,
          tau=run.taus[effort], steps=ph["steps"], group_size=c.group_size,
          width=run.config.rollout.width, seed=seed * 10 + di,
          log=functools.partial(log_step, bar=bar), loop=loop,
          reference={"sampler": None, "sft": root, "parent": params}[ph["reference"]],
          plateau=(c.get("plateau_window", 0), c.get("plateau_delta", 0.0)))
    bar.close()
    log.close()
    metrics = sft.evaluate(run.eval_engine, state.params, task, val, effort,
                           _eval_budgets(run, val, effort), jax.random.PRNGKey(7))
    checkpoint.save_params(out, state.params)
    record[name] = {
        "domain": domain, "effort": effort, "tau": run.taus[effort],
        "step": len(hist), "parent": parent, "path": out,
        "pmd_reference": ph["reference"], "lr": ph["lr"], "tau_kl": ph["tau_kl"],
        "config_hash": config_hash(run.config), "seconds": time.time() - t0,
        "eval_validation": metrics, "model": model_signature(run.model_cfg),
        "data_state": it.state(),
        "train_curve": [[s, m["reward"], m["length"]] for s, m in hist]}
    save()
    params, parent = state.params, out


def model_signature(cfg: models.ModelConfig) -> dict:
  """What a teacher must share with the student to be scored against it (manifest field)."""
  return {"family": cfg.family, "vocab_size": cfg.vocab_size, "num_layers": cfg.num_layers,
          "d_model": cfg.d_model}


def validate_manifest(run: Run, manifest: dict, path: str) -> None:
  """Nine cells present, each checkpoint where the manifest says, and each teacher of the
  student's architecture family and vocabulary; raises naming the offending cells."""
  cells = manifest.get("teachers") if isinstance(manifest, dict) else None
  if not isinstance(cells, dict):
    raise ValueError(f"teacher manifest {path} has no 'teachers' mapping")
  missing = [n for n in teachers.DEFAULT_NAMES if n not in cells]
  if missing:
    raise FileNotFoundError(f"teacher manifest {path} lacks {missing} (nine cells "
                            f"{list(teachers.DEFAULT_NAMES)} are needed); run the rl stage")
  problems = []
  student = model_signature(run.model_cfg)
  for name in teachers.DEFAULT_NAMES:
    entry = cells[name]
    if not os.path.isdir(entry.get("path", "")):
      problems.append(f"{name}: no checkpoint directory {entry.get('path')!r}")
    if entry.get("format") == "hf":
      from mopd_jax import hf
      try:
        teachers.check_compatible(run.model_cfg, hf.resolve_model_config(
            run.config.teacher, run.tok.vocab_size, hf_path=entry["path"]), what=name)
      except (ValueError, OSError) as e:
        problems.append(f"{name}: {e}")
      continue
    sig = entry.get("model", student)  # manifests written before this field: checked on load
    # rl-stage teachers are copies of pi_SFT: family, vocabulary and shape all match.
    diffs = [f"{k} {sig.get(k)!r} (student: {v!r})" for k, v in student.items()
             if sig.get(k) != v]
    if diffs:
      problems.append(f"{name}: " + ", ".join(diffs))
  if problems:
    raise ValueError(f"teacher manifest {path} is inconsistent with the student:\n  " +
                     "\n  ".join(problems))


def teacher_table(manifest: dict) -> str:
  lines = ["teacher     tau   acc(val)  length  over-budget",
           "----------  ----  --------  ------  -----------"]
  for name, t in sorted(manifest["teachers"].items()):
    m = t["eval_validation"]
    if m is None:
      continue
    lines.append(f"{name:10s}  {t['tau']:.2f}  {m['accuracy']:8.3f}  {m['mean_length']:6.1f}  "
                 f"{m['over_budget_rate']:11.3f}")
  return "\n".join(lines)


def load_bank(run: Run) -> teachers.TeacherBank:
  manifest = checkpoint.read_json(run.path("teachers.json"))
  validate_manifest(run, manifest, run.path("teachers.json"))
  plist = [run.load_teacher(manifest["teachers"][n]) for n in teachers.DEFAULT_NAMES]
  # Placed once, as the scorer wants it (placement.TeacherScorer then holds no second copy).
  shard = sharding.param_shardings(run.teacher_cfg, run.teacher_mesh, num_stacked=len(plist))
  return teachers.build_bank(run.teacher_cfg, plist, names=teachers.DEFAULT_NAMES,
                             student_cfg=run.model_cfg, sharding=shard)


def teacher_sft_init(run: Run, student, bank: teachers.TeacherBank):
  """pi_SFT further fine-tuned on trajectories of all nine teachers, each with its effort
  token (K3 §4.1.2): rollouts of teacher (d, e) on training prompts at effort e, kept when
  they finish within the cell's budget, then SFT on the pooled set. Returns (params, pool
  size); the pool size is None when a restart found the init already finished."""
  c = run.config.mopd
  trainer = train.Trainer(run.model_cfg, train.LossConfig(kind="sft"),
                          train.OptimConfig(lr=run.config.sft.lr, warmup_steps=0,
                                            total_steps=c.init_sft_steps,
                                            microbatches=c.get("microbatches", 1)), run.mesh)
  with run.train_loop("mopd init: teacher SFT", run.path("mopd", "init_ckpt"),
                      c.init_sft_steps) as loop:
    state = loop.restore(trainer.abstract_state(run.params_like()))
    if state is not None and loop.start_step == c.init_sft_steps:
      return state.params, None  # finished before a restart: no need to rebuild the pool
    pool = _teacher_pool(run, bank)  # deterministic: rebuilt alike after a restart
    if state is None:
      state = trainer.init(student)
    bar = Progress("mopd init: teacher SFT", c.init_sft_steps, initial=loop.start_step)
    width = width_for(pool)  # one width for the whole pool: one compilation
    for step in range(loop.start_step, c.init_sft_steps):
      # A pure function of (seed, step): a resumed init draws the same batches.
      rng = np.random.RandomState([run.config.seed + 500, step])
      picks = [pool[i] for i in rng.randint(len(pool), size=run.config.sft.batch_size)]
      arr = rollout.pad_batch(picks, run.tok.pad_id, width)
      batch = train.TrainBatch(tokens=jax.numpy.asarray(arr["tokens"]),
                               input_mask=jax.numpy.asarray(arr["input_mask"]),
                               loss_mask=jax.numpy.asarray(arr["loss_mask"]))
      state, m = trainer.step(state, batch)
      m = {k: float(v) for k, v in jax.device_get(m).items()}
      loop.end_step(step, state, m, [step, m["loss"]])
      bar.update(m)
  bar.close()
  return state.params, len(pool)


def _teacher_pool(run: Run, bank: teachers.TeacherBank) -> list:
  """Teacher trajectories that finished within their cell's budget."""
  c = run.config.mopd
  pool = []
  for k, name in enumerate(bank.router.names):
    d, e = name.split("/")
    tparams = jax.tree.map(lambda x: x[k], bank.params)
    exs = next(run.iterator(d, c.init_samples_per_cell, salt=300 + k))
    res = run.teacher_engine(sampling=True).run(tparams, exs, [e] * len(exs),
                                                _eval_budgets(run, exs, e),
                         jax.random.PRNGKey(run.config.seed + 400 + k),
                         environment=get_task(d).environment)
    pool += [t for t, over in zip(res.trajectories, res.over_budget) if not over]
  if not pool:
    raise RuntimeError("no teacher trajectory finished within its budget; cannot build the "
                       "teacher-SFT initialisation")
  return pool


def _prompts_across_efforts(c: ml_collections.ConfigDict) -> str:
  mode = c.get("prompts_across_efforts", "distinct")
  if mode not in ("distinct", "shared"):
    raise ValueError(f"mopd.prompts_across_efforts={mode!r}; expected 'distinct' or 'shared'")
  mix = tuple(c.get("effort_mix", ()))
  if mix and not (len(mix) == len(EFFORTS) and all(w >= 0 for w in mix) and sum(mix) > 0):
    raise ValueError(f"mopd.effort_mix={mix!r}; expected {len(EFFORTS)} weights >= 0 (efforts "
                     f"{EFFORTS}), not all 0, or () for prompts_per_cell prompts per cell")
  if mix and mode == "shared":
    raise ValueError("mopd.effort_mix draws one effort per prompt; it needs "
                     "mopd.prompts_across_efforts='distinct' (shared poses every prompt at "
                     "every effort)")
  return mode


def cell_prompts(iters: dict, per_cell: int, shared: bool, mix: Sequence[float] = (),
                 rng: Optional[np.random.RandomState] = None) -> list:
  """One step's prompts of every (domain, effort) cell, in `cells` order (domain-major).

  `shared`: each domain's `per_cell` prompts are posed at all three efforts, so the three
  cells' updates of a domain differ only by the effort token and whatever the student and
  its teachers make of it; else each cell gets `per_cell` prompts of its own (the domain's
  iterator then yields 3 x `per_cell`). `mix` (distinct only): weights of the efforts, in
  `EFFORTS` order; each prompt's effort is then drawn from them with `rng`, so a cell holds
  anywhere from 0 to 3 x `per_cell` prompts."""
  out = []
  for d in DOMAINS:
    exs = list(next(iters[d]))
    if mix:
      p = np.asarray(mix, np.float64) / np.sum(mix)
      drawn = rng.choice(len(EFFORTS), size=len(exs), p=p)
      out.extend([ex for ex, e in zip(exs, drawn) if e == j] for j in range(len(EFFORTS)))
      continue
    for j, _ in enumerate(EFFORTS):
      out.append(exs if shared else exs[j * per_cell:(j + 1) * per_cell])
  return out


def mopd_stage(run: Run) -> None:
  """The student: pi_SFT distilled from all nine teachers on its own rollouts.

  `mopd.staleness` 1 runs the same steps through `async_scoring.run`: the teachers score
  batch k while the student samples batch k+1, and the stale batch is importance-weighted.
  """
  c = run.config.mopd
  bank = load_bank(run)
  if c.init not in ("sft", "teacher_sft"):
    raise ValueError(f"mopd.init={c.init!r}; expected 'sft' or 'teacher_sft'")
  staleness = c.get("staleness", 0)
  loss_cfg = train.LossConfig(kind=c.loss, r_max=c.r_max,
                              is_bounds=tuple(c.get("is_bounds", (0.5, 2.0)))
                              if staleness else None)
  trainer = train.Trainer(run.model_cfg, loss_cfg,
                          train.OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps,
                                            total_steps=c.steps,
                                            microbatches=c.get("microbatches", 1)), run.mesh)
  tasks = {d: get_task(d) for d in DOMAINS}
  cells = [(d, e) for d in DOMAINS for e in EFFORTS]
  shared = _prompts_across_efforts(c) == "shared"
  mix = tuple(c.get("effort_mix", ()))
  iters = {d: run.iterator(d, c.prompts_per_cell * (1 if shared else len(EFFORTS)),
                           salt=200 + i) for i, d in enumerate(DOMAINS)}
  # Co-located or disaggregated (config.placement): log-probs come back on the student mesh.
  # The teachers score at `mopd.teacher_temperature` (their own rollouts, for the
  # teacher_sft init, stay at the RL temperature).
  scoring = bank.replace(params=models.with_temperature(bank.params,
                                                        c.get("teacher_temperature", 1.0)))
  scorer = placement.TeacherScorer(scoring, run.mesh, run.teacher_mesh,
                                   top_k=c.get("top_k", 8) if c.loss == "topk" else 0)
  log = run.logger("mopd")
  t0 = time.time()
  # Iterator positions before each step's prompts were drawn: with staleness 1 the next
  # step's prompts are already drawn when a step is checkpointed, and a resumed run must
  # draw them again.
  drawn_at, last_step = {}, [-1]

  def data_state():
    return drawn_at.get(last_step[0] + 1) or {d: it.state() for d, it in iters.items()}

  def sample(params, step):
    drawn_at[step] = {d: it.state() for d, it in iters.items()}
    # Effort draws: a pure function of (seed, step), so a resumed run draws the same.
    per_cell = cell_prompts(iters, c.prompts_per_cell, shared, mix,
                            np.random.RandomState([run.config.seed, step]))
    rng = jax.random.fold_in(jax.random.PRNGKey(run.config.seed + 3), step)
    return mopd.sample_batch(params, bank, run.engine, tasks, cells, per_cell, run.taus, rng,
                             rows_per_teacher=c.prompts_per_cell * (len(EFFORTS) if mix else 1))

  def submit(sampled):  # dispatched without blocking: JAX's async dispatch
    return scorer.submit(sampled.tokens, sampled.input_mask)

  def train_fn(state, sampled, scored):
    return mopd.train_on(trainer, state, bank, sampled, scorer.fetch(scored), r_max=c.r_max,
                         alpha=c.get("alpha", 0.0))

  # The student checkpoint holds only the student's TrainState: teachers are loaded from the
  # manifest on every (re)start and never saved with it.
  with run.train_loop("mopd", run.path("mopd", "ckpt"), c.steps, data_state) as loop:
    state = loop.restore(trainer.abstract_state(run.params_like()))
    if state is None:
      student = checkpoint.load_params(run.path("sft", "params"), run.params_like())
      if c.init == "teacher_sft":
        student, pool_size = teacher_sft_init(run, student, bank)
        print(f"[mopd] student initialised by SFT on "
              f"{pool_size if pool_size is not None else 'restored'} teacher trajectories")
      state = trainer.init(student)
    else:
      for d, pos in loop.data.items():
        iters[d].restore(pos)
    bar = Progress("mopd", c.steps, initial=loop.start_step)

    def on_step(step, state, rec):
      last_step[0] = step
      drawn_at.pop(step, None)
      loop.end_step(step, state, rec.metrics, {"step": step, **rec.metrics, "cells": rec.cells})
      bar.update(rec.metrics, keys=("loss", "kl", "accuracy", "length"))
      log.scalars(step, rec.metrics)
      for name, cm in rec.cells.items():
        log.scalars(step, cm, prefix=f"{name}/")

    state, _, times = async_scoring.run(state, c.steps, sample=sample, submit=submit,
                                        train=train_fn, staleness=staleness, on_step=on_step,
                                        start_step=loop.start_step)
    history = loop.history
  bar.close()
  log.close()
  checkpoint.save_params(run.path("mopd", "params"), state.params)
  checkpoint.write_json(run.path("mopd", "history.json"), history)
  run.mark_done("mopd", {"steps": c.steps, "seconds": time.time() - t0, "staleness": staleness,
                         "phase_seconds_per_step": times.per_step(),
                         "kl_initial": history[0]["kl"], "kl_final": history[-1]["kl"]})


def eval_stage(run: Run) -> None:
  """pi_SFT in every (domain, effort) cell and each teacher in its own cell, test split."""
  like = run.params_like()
  policies = {"sft": checkpoint.load_params(run.path("sft", "params"), like)}
  if os.path.exists(run.path("mopd", "params")):
    policies["student"] = checkpoint.load_params(run.path("mopd", "params"), like)
  manifest = checkpoint.read_json(run.path("teachers.json"), default={"teachers": {}})
  cells = []
  n = run.config.eval.num_examples
  bar = Progress("eval", len(DOMAINS) * len(EFFORTS))  # one step = one (domain, effort) cell
  for domain in DOMAINS:
    task = get_task(domain)
    test = run.split(domain, "test")
    exs = [test[i] for i in range(min(n, len(test)))]
    for effort in EFFORTS:
      budgets = _eval_budgets(run, exs, effort)
      m = sft.evaluate(run.eval_engine, policies["sft"], task, exs, effort, budgets,
                       jax.random.PRNGKey(11))
      cells.append({"policy": "sft", "domain": domain, "effort": effort, **m})
      if "student" in policies:
        m = sft.evaluate(run.eval_engine, policies["student"], task, exs, effort, budgets,
                         jax.random.PRNGKey(11))
        cells.append({"policy": "student", "domain": domain, "effort": effort, **m})
      t = manifest["teachers"].get(f"{domain}/{effort}")
      if t is not None:
        m = sft.evaluate(run.teacher_engine(), run.load_teacher(t), task, exs, effort,
                         budgets, jax.random.PRNGKey(11))
        cells.append({"policy": "teacher", "domain": domain, "effort": effort, **m})
      bar.update(cells[-1], keys=("accuracy", "mean_length"))
  bar.close()
  log = run.logger("eval")  # final cells as scalars: "<policy>/<domain>/<effort>/accuracy"
  for c in cells:
    log.scalars(0, {k: c[k] for k in ("accuracy", "mean_length", "over_budget_rate")},
                prefix=f"{c['policy']}/{c['domain']}/{c['effort']}/")
  log.close()
  checkpoint.write_json(run.path("eval.json"), {"cells": cells})
  run.mark_done("eval", {"num_cells": len(cells)})
  print(cells_table(cells))


def cells_table(cells) -> str:
  lines = ["policy   domain effort  accuracy  length  over-budget   n",
           "-------  ------ ------  --------  ------  -----------  ---"]
  for c in cells:
    lines.append(f"{c['policy']:7s}  {c['domain']:6s} {c['effort']:6s}  {c['accuracy']:8.3f}  "
                 f"{c['mean_length']:6.1f}  {c['over_budget_rate']:11.3f}  {c['n']:3d}")
  return "\n".join(lines)


def report_stage(run: Run) -> None:
  from mopd_jax import report
  timings = checkpoint.read_json(run.path("timings.json"), default={"_": 0})
  timings.pop("_", None)
  timings["total"] = sum(timings.values())
  rep = report.write(run.workdir, json.loads(run.config.to_json()), timings)
  run.mark_done("report", {"kl": rep["kl"]["final"]})
  print(f"report: {run.path('report.md')}")


_STAGE_FNS = {"smoke": smoke, "data": data, "sft": sft_stage, "rl": rl_stage,
              "mopd": mopd_stage, "eval": eval_stage, "report": report_stage}


def run(config: ml_collections.ConfigDict, workdir: Optional[str] = None) -> None:
  stages = [s.strip() for s in config.stages.split(",") if s.strip()]
  unknown = [s for s in stages if s not in STAGES]
  if unknown:
    raise ValueError(f"unknown stage(s) {unknown}; known stages in order: {STAGES}")
  if workdir is None and stages != ["smoke"]:
    raise ValueError("--workdir is required for every stage but smoke")
  ctx = Run(config, workdir or os.getcwd())
  timings = {}
  with checkpoint.sigterm_guard():
    for stage in STAGES:
      if stage in stages:
        _run_stage(ctx, stage, timings)
  return timings


def _run_stage(ctx: Run, stage: str, timings: dict) -> None:
  """One stage unless already done; a SIGTERM that arrived between stages stops here."""
  if stage != "smoke" and ctx.done(stage):
    print(f"[{stage}] already done in {ctx.workdir}; skipping")
    return
  if checkpoint.preemption_requested():
    raise checkpoint.Preempted(f"SIGTERM received before stage {stage}; finished stages are "
                               "kept. Run the same command again to continue.")
  t0 = time.time()
  _STAGE_FNS[stage](ctx)
  # Multi-process: nobody starts the next stage before every process finished this one and
  # process 0's files (data, DONE.json, manifests) are on the shared workdir.
  distributed.sync(f"stage {stage} done")
  timings[stage] = time.time() - t0
  print(f"[{stage}] finished in {timings[stage]:.1f}s")
  if stage not in ("smoke", "report"):
    all_t = checkpoint.read_json(ctx.path("timings.json"), default={"_": 0})
    all_t[stage] = timings[stage]
    checkpoint.write_json(ctx.path("timings.json"), all_t)
