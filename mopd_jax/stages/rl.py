"""The rl stage: one lane per domain, each annealing its efforts from the largest tau down
from pi_SFT (mopd_jax/training/rl.py), freezing a teacher per (domain, effort) cell; the manifest
`<workdir>/teachers.json` records them with the grid they were trained on.

Lanes share nothing, so they run one after another in this process or side by side in
processes of their own (`rl.lane_processes`; the worker and its command: mopd_jax/stages/lanes.py,
which builds the same `Inputs` from the run's resolved config). The stage takes its
`Inputs` (built by `stages/wiring.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator, Mapping, Optional

import jax
from jax.sharding import Mesh

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.io import checkpoint, storage
from mopd_jax.rollout import partial
from mopd_jax.stages import lanes as lanes_mod, loops, sources
from mopd_jax.tasks import base as task_base, grid as grid_mod, views
from mopd_jax.teachers import bank as teachers
from mopd_jax.training import rl, sft, step as train

MANIFEST = "teachers.json"


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the rl stage reads and works with. `config_json`: the run's resolved config, for
  the lane processes; `teacher_hf_paths`: cells brought as checkpoints ({} = train them);
  `engine` / `eval_engine`: the student's samplers at `rl.temperature` and
  `eval.temperature`; `data`: the run's datasets (`iterator(domain, batch_size, salt,
  seed=)`: a domain's training batches; `split(domain, split, measured_b0=)`: a split's
  examples; `budgets_path(domain)`: where a record domain's measured b0s go, None: not
  measured); `policies.like()`: the restore target of a policy."""
  cfg: config_mod.RlConfig
  budget: config_mod.BudgetConfig
  seed: int
  outside: tuple
  rollout_width: int
  config_hash: str
  config_json: str
  grid: grid_mod.Grid
  view: views.PromptView
  model_cfg: models.ModelConfig
  mesh: Mesh
  teacher_hf_paths: Mapping[str, str]
  teacher_tokenizers: Mapping[str, Any]  # cell -> the manifest's record of its teacher's tokenizer
  tasks: Mapping[str, task_base.Task]
  engine: Any
  eval_engine: Any
  data: sources.DataSource
  policies: sources.Policies
  files: loops.Workdir
  loops: loops.Loops

  def budgets(self, examples, effort: str) -> list:
    return task_base.effort_budgets(examples, effort, self.grid.taus)


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


def lanes_of(inp: Inputs) -> list:
  """The rl stage's lanes, in the order they run one after another."""
  order, path = inp.grid.anneal_order, inp.files.path
  out = [Lane(d, path("sft", "params"), path("rl", d), order, "teachers", inp.seed)
         for d in inp.grid.domains]
  cell, outside_seed = inp.outside
  if cell:
    # The outside teacher goes through its cell's own anneal (largest tau -> ... -> its
    # effort), from the outside SFT, in a lane of its own.
    d, e = cell.split("/")
    out.append(Lane(d, path("sft", "outside", "params"), path("rl_outside", d),
                    order[:order.index(e) + 1], "outside", outside_seed, "outside "))
  return out


def lane_steps(inp: Inputs, lane: Lane) -> list:
  return [rl.phase_settings(inp.cfg, e, inp.grid.anneal_order)["steps"] for e in lane.efforts]


def measure_budgets(inp: Inputs) -> None:
  """`budget.source=samples`: b0 of every record domain's examples from k samples of pi_SFT
  at the top effort (as the teachers see the prompt), once, before the first budgeted
  effort (mopd_jax/tasks/budgets.py)."""
  from mopd_jax.tasks import budgets  # pylint: disable=g-import-not-at-top
  from mopd_jax.runtime import distributed
  params, k = None, inp.budget.samples
  for i, d in enumerate(inp.grid.domains):
    path = inp.data.budgets_path(d)
    if path is None or storage.exists(path):
      continue
    if params is None:
      params = checkpoint.load_params(inp.files.path("sft", "params"), inp.policies.like())
    task, b0, solved = inp.tasks[d], {}, {}
    for split in ("train", "validation", "test"):
      exs = exs_of(inp, d, split)
      got = budgets.measure(inp.engine, params, task, examples=exs,
                            prompt_effort=inp.view.teacher(inp.grid.top_effort), k=k,
                            rng=jax.random.PRNGKey(inp.seed * 100 + 60 + i))
      b0.update({ex.uid: v for ex, v in zip(exs, got)})
      solved[split] = sum(v is not None for v in got)
    counts = budgets.summary(b0)
    print(f"[rl] {d}: b0 from {k} samples of pi_SFT: {counts}")
    if not solved["train"]:
      raise RuntimeError(
          f"budget.source=samples: pi_SFT solved none of domain {d!r}'s training prompts in "
          f"{k} samples, so no prompt has a b0; raise budget.samples "
          "or use budget.source=reference or field")
    if distributed.is_main():
      checkpoint.write_json(path, {"b0": b0, "k": k, "counts": counts})
  distributed.sync("budgets measured")


def exs_of(inp: Inputs, domain: str, split: str) -> list:
  src = inp.data.split(domain, split, measured_b0=False)
  return [src[j] for j in range(len(src))]


def run(inp: Inputs) -> None:
  measure_budgets(inp)
  path = inp.files.path(MANIFEST)
  manifest = checkpoint.read_json(path, default={"teachers": {}})
  teachers.check_manifest_grid(manifest, path, inp.grid)
  manifest["grid"] = inp.grid.to_json()
  if inp.teacher_hf_paths:  # teachers brought as checkpoints: register, do not train
    for name in inp.grid.names:
      hf_path = inp.teacher_hf_paths[name]
      if not storage.isdir(hf_path):
        raise FileNotFoundError(f"teacher {name}: no checkpoint directory {hf_path}")
      d, e = name.split("/")
      manifest["teachers"][name] = {"domain": d, "effort": e, "tau": inp.grid.taus[e], "step": 0,
                                    "parent": hf_path, "path": hf_path, "format": "hf",
                                    "config_hash": inp.config_hash,
                                    "tokenizer": dict(inp.teacher_tokenizers[name]),
                                    "eval_validation": None}
    checkpoint.write_json(path, manifest)
    inp.files.mark_done("rl", {"teachers": sorted(manifest["teachers"]), "source": "hf"})
    return
  lanes = lanes_of(inp)
  processes = lanes_mod.process_count(inp.cfg, len(lanes))
  if processes > 1:
    # Each lane process keeps its records in its lane directory; they join the manifest here.
    lanes_mod.run_side_by_side(inp.files.root, inp.config_json, lanes,
                               processes=processes,
                               total_steps=[sum(lane_steps(inp, lane)) for lane in lanes])
    for lane in lanes:
      manifest.setdefault(lane.section, {}).update(lanes_mod.read_records(lane))
  else:
    trainers = {}
    for lane in lanes:
      section = manifest.setdefault(lane.section, {})
      for name, entry in train_lane(inp, lane, section, trainers=trainers):
        section[name] = entry
        checkpoint.write_json(path, manifest)  # each teacher on record once it exists
  cell, outside_seed = inp.outside
  if cell:
    # Route the cell to the outside teacher; the same-origin one it replaces stays on record.
    # Without its data_state: a restarted same-origin lane restores its own stream from
    # `teachers`, and the outside lane's stream is not it.
    if manifest["teachers"][cell].get("origin") != "outside":
      manifest.setdefault("same_origin", {})[cell] = manifest["teachers"][cell]
    manifest["teachers"][cell] = {
        **{k: v for k, v in manifest["outside"][cell].items() if k != "data_state"},
        "origin": "outside", "sft_seed": outside_seed}
  checkpoint.write_json(path, manifest)
  inp.files.mark_done("rl", {"teachers": sorted(manifest["teachers"]),
                       **({"outside_cell": cell} if cell else {})})
  print(teachers.teacher_table(manifest))


def trainer_for(inp: Inputs, ph: dict, trainers: dict) -> train.Trainer:
  """The trainer of an effort phase's settings `ph` (`rl.phase_settings`), from the cache
  `trainers` or new: a fresh optimizer per phase, its cosine over the phase's steps."""
  c = inp.cfg
  key = (ph["lr"], ph["tau_kl"], ph["steps"])
  if key not in trainers:
    loss_cfg = train.LossConfig(kind=c.loss, group_size=c.group_size, tau_kl=ph["tau_kl"],
                                args=c.loss_args)
    trainers[key] = train.Trainer(
        inp.model_cfg, loss_cfg,
        train.OptimConfig(lr=ph["lr"], warmup_steps=0, total_steps=ph["steps"],
                          microbatches=c.microbatches, length_groups=c.length_groups),
        mesh=inp.mesh)
  return trainers[key]


def _log_step(step: int, m: dict, *, bar, log, effort: str, on_step=None) -> None:
  """After each RL step: the progress bar, the metric log, the caller's `on_step`."""
  bar.update(m)
  log.scalars(step, m)
  if on_step is not None:
    on_step(effort, step, m)


@dataclasses.dataclass(frozen=True)
class LaneData:
  """A phase's data streams as its checkpoint keeps them: the lane's training iterator and
  the phase's partial-rollout pool (None: whole trajectories)."""
  it: Any
  pool: Optional[partial.RolloutPool] = None

  def state(self) -> dict:
    return {"train": self.it.state(),
            **({} if self.pool is None else {"in_flight": self.pool.state()})}

  def restore(self, data: dict) -> None:
    self.it.restore(data["train"])
    if self.pool is not None:
      self.pool.restore(data.get("in_flight"))


def train_lane(inp: Inputs, lane: Lane, done: dict, *, trainers: Optional[dict] = None,
               on_step=None) -> Iterator[tuple]:
  """Trains the lane's efforts not yet in `done` (its manifest section so far), yielding
  (name, manifest entry) as each teacher is frozen; the caller records it.

  `trainers`: a cache shared by lanes run in one process (a Trainer holds configs and
  compiled steps, no state, so phases with the same settings share one, and so its
  compilations: several seconds each on a CPU). `on_step(effort, step, metrics)`: called
  after every RL step."""
  c = inp.cfg
  order = inp.grid.anneal_order
  trainers = {} if trainers is None else trainers
  like = inp.policies.like()
  domain, tag, seed = lane.domain, lane.tag, lane.seed
  di = inp.grid.domains.index(domain)
  task = inp.tasks[domain]
  storage.makedirs(lane.directory)
  parent = lane.parent
  params = root = checkpoint.load_params(parent, like)
  it = inp.data.iterator(domain, c.prompts_per_step, salt=100 + di, seed=seed)
  validation = inp.data.split(domain, "validation")
  val = [validation[i] for i in range(min(c.validation_examples, len(validation)))]
  for effort in lane.efforts:
    name = f"{domain}/{effort}"
    out = storage.join(lane.directory, f"teacher_{effort}")
    if name in done and storage.exists(out):
      params, parent = checkpoint.load_params(out, like), out
      if "data_state" in done[name]:  # the next effort reads on from here
        it.restore(done[name]["data_state"])
      continue
    log = inp.loops.logger(f"rl_{lane.name}_{effort}")
    t0 = time.time()
    ph = rl.phase_settings(c, effort, order)
    trainer = trainer_for(inp, ph, trainers)
    # Partial rollouts: a pool per phase (its rows are sampled at the phase's budget), so
    # rows still in flight when the phase ends are dropped.
    pool = partial.RolloutPool(c.partial_rollout_tokens) if c.partial_rollout_tokens else None

    streams = LaneData(it, pool)
    # One checkpoint directory per (domain, effort) run: lanes never share state.
    with inp.loops.training(f"rl {tag}{name}", storage.join(lane.directory, f"ckpt_{effort}"),
                            trainer, total_steps=ph["steps"],
                            init=lambda p=params: trainer.init(p), data_state=streams.state,
                            restore_data=streams.restore) as (loop, state, bar):
      log_step = functools.partial(_log_step, bar=bar, log=log, effort=effort, on_step=on_step)
      sampling = rl.PhaseSampling(
          inp.engine, view=inp.view,
          reference={"sampler": None, "sft": root, "parent": params}[ph["reference"]],
          sample_from=c.sample_from, pool=pool,
          relogprob=(lambda arr, params: partial.recompute_logprobs(inp.model_cfg, params, arr))
          if pool is not None and c.partial_mode == "recompute" else None)
      phase = rl.EffortPhase(effort=effort, tau=inp.grid.taus[effort], phase=order.index(effort),
                             steps=ph["steps"], group_size=c.group_size,
                             width=inp.rollout_width, seed=seed * 10 + di,
                             plateau=(c.plateau_window, c.plateau_delta))
      state, hist = rl.run_effort(trainer, state, sampling, task=task,
                                  next_examples=lambda step: next(it), phase=phase,
                                  log=log_step, loop=loop)
    log.close()
    # The lane's teacher is validated on the prompts it trains on.
    metrics = sft.evaluate(inp.eval_engine, state.params, task, examples=val,
                           effort=inp.view.teacher(effort), budgets=inp.budgets(val, effort),
                           rng=jax.random.PRNGKey(7)) if val else None
    checkpoint.save_params(out, state.params)
    yield name, {
        "domain": domain, "effort": effort, "tau": inp.grid.taus[effort],
        "step": len(hist), "parent": parent, "path": out,
        "pmd_reference": ph["reference"], "sample_from": c.sample_from, "lr": ph["lr"],
        "tau_kl": ph["tau_kl"],
        "config_hash": inp.config_hash, "seconds": time.time() - t0,
        "eval_validation": metrics, "model": teachers.model_signature(inp.model_cfg),
        "data_state": it.state(),
        "train_curve": [[s, m["reward"], m["length"]] for s, m in hist]}
    params, parent = state.params, out
