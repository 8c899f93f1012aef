"""TFDS builders for the toy domains and a resumable, deterministic batch iterator.

One builder, `mopd_tasks`, with a config per domain (`mopd_tasks/gen`, `/agt`, `/cod`; custom
seeds and sizes get their own config name, hence their own folder). Examples are generated
procedurally from the seed by `get_task(domain).generate` and stored as one JSON string feature
(`Example.to_json`) in `array_record` files:

    <data_dir>/mopd_tasks/<config>/1.2.0/mopd_tasks-{train,validation,test}.array_record-*

Building and reading need no TensorFlow (checked with tensorflow-datasets 4.9.10, TensorFlow
not installed): `GeneratorBasedBuilder.download_and_prepare(file_format="array_record")` writes
the files itself and `as_data_source()` reads them through `array_record`. Shuffling at write
time is disabled, so record i of a split is the i-th generated example.

Splits: train, validation and test are generated from different streams (seed*3 + 0/1/2) and
are disjoint by underlying problem (`Task.problem_key`: gen's terms, cod's program, agt's
chain), not only by prompt string: validation skips every train problem, test every train or
validation problem.

Domains of record files (the `records` task) use the same builder: their config carries the
files and settings as JSON (`records_settings`) and a fingerprint of the files' bytes in its
name, so changed files get their own folder. The train file gives train and validation
(`validation` records held out by a permutation of the seed), the test file gives test;
`mopd_jax.tasks.records` reads, checks, deduplicates and converts them, and the counts of
what was kept, dropped and skipped are stored in the dataset's metadata (`record_counts`).

    source = load_split("gen", "train", data_dir)           # random access, Example items
    it = ResumableIterator(source, batch_size=32, seed=0)
    batch = next(it)                                        # list[Example]
    state = it.state()                                      # JSON-serialisable
    it2 = ResumableIterator(source, 32, seed=0); it2.restore(state)   # same next batches

Record domains (real data, the pods' path) are read by `GrainIterator` instead: a grain
`IndexSampler` sharded by JAX process (`ShardByJaxProcess`), so each process reads only its
own shard of the training prompts, shuffled with the seed, endless; the global batch is the
processes' local batches in process order (the examples' JSON all-gathered), and the state
is every process's grain iterator state, so a resume continues each shard exactly. The toy
domains keep `ResumableIterator`, whose order the toy's measured results were produced with.
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from typing import Any, Sequence

from etils import epath
import numpy as np
import tensorflow_datasets as tfds

from mopd_jax.tasks import base, budgets, get_task, records as recs_mod

SPLITS = ("train", "validation", "test")
# (train, validation, test) examples per domain in the default configs.
DEFAULT_SIZES = (4000, 300, 300)
FILE_FORMAT = "array_record"


@dataclasses.dataclass(eq=False)
class TaskConfig(tfds.core.BuilderConfig):
  """Which domain (and the registered task that generates it), from which seed, how many
  examples per split."""
  domain: str = "gen"
  task: str = ""  # "" = the task named like the domain
  seed: int = 0
  num_train: int = DEFAULT_SIZES[0]
  num_validation: int = DEFAULT_SIZES[1]
  num_test: int = DEFAULT_SIZES[2]
  records: str = ""  # the `records` task: records_settings(...) as JSON
  options: str = ""  # the task's options (its constructor's keyword arguments) as JSON


def records_settings(spec, *, budget_source: str, max_prompt_tokens: int, on_too_long: str,
                     tokenizer: str, tokenizer_options: dict, efforts: Sequence[str]) -> str:
  """Everything that decides a record domain's examples, as the JSON of its TaskConfig.
  `spec`: the domain's `records` entry of the run config (its `train` and `test` files,
  `verifier` and `validation` size)."""
  return json.dumps(dict(train=spec.train, test=spec.test, verifier=spec.verifier,
                         validation=spec.validation,
                         budget_source=budget_source, max_prompt_tokens=max_prompt_tokens,
                         on_too_long=on_too_long, tokenizer=tokenizer,
                         tokenizer_options=tokenizer_options, efforts=list(efforts)),
                    sort_keys=True)


def make_config(domain: str, seed: int = 0, sizes: Sequence[int] | None = None,
                *, task: str = "", records: str = "", options: str = "") -> TaskConfig:
  """The config for (domain, seed, sizes, task); the defaults are the registered
  `mopd_tasks/<d>`. `task`: the registered task generating the domain ("" = `domain`).
  `records`: a record domain's `records_settings`. `options`: the task's options as JSON
  ("" = its defaults), part of the config's name."""
  base.validate_domain(domain)
  task = "" if task == domain else task
  if (task or domain) not in base.registered():
    raise ValueError(f"unknown task {task or domain!r}; registered: {list(base.registered())}")
  sizes = tuple(int(s) for s in (sizes or DEFAULT_SIZES))
  if len(sizes) != 3 or min(sizes) < 0:
    raise ValueError(f"sizes must be three non-negative ints (train, validation, test), got "
                     f"{sizes!r}")
  if not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  if records:
    settings = json.loads(records)
    digest = hashlib.sha256((records + f"|{seed}|" + recs_mod.fingerprint(
        [settings["train"], settings["test"]])).encode()).hexdigest()[:16]
    return TaskConfig(name=f"{domain}_records_{digest}", domain=domain, task=task, seed=seed,
                      num_train=0, num_validation=settings["validation"], num_test=0,
                      records=records, description=f"{domain}: records of "
                      f"{settings['train']} and {settings['test']}")
  name = domain if (seed, sizes) == (0, DEFAULT_SIZES) else \
      f"{domain}_s{seed}_{sizes[0]}_{sizes[1]}_{sizes[2]}"
  if task:
    name += f"_{task}"
  if options:
    name += "_o" + hashlib.sha256(options.encode()).hexdigest()[:12]
  return TaskConfig(name=name, domain=domain, task=task, seed=seed, num_train=sizes[0],
                    num_validation=sizes[1], num_test=sizes[2], options=options,
                    description=f"{domain} ({task or domain} task), seed {seed}, sizes {sizes}"
                    + (f", options {options}" if options else ""))


class MopdTasks(tfds.core.GeneratorBasedBuilder):
  """Procedural toy tasks of mopd_jax, one config per domain."""

  VERSION = tfds.core.Version("1.2.0")
  RELEASE_NOTES = {"1.0.0": "gen/agt/cod toy tasks with full/brief/direct solutions.",
                   "1.1.0": "Held-out splits disjoint from train by underlying problem.",
                   "1.2.0": "gen terms and cod digits: 0 half the time (tasks.base.ZERO_PROB)."}
  # A named config per generated task registered when this module loads (the package's);
  # a task registered later (a plugin) gets its config object from `make_config`.
  BUILDER_CONFIGS = [make_config(d) for d in base.registered() if base.task_class(d).generated]

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # tfds 4.9.10's own code_path touches `importlib_resources`, a package it only declares
    # for Python < 3.9, whenever the builder lives in a package; this file is the answer.
    return epath.Path(inspect.getfile(cls))

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly: `dataset_info_from_configs` wants metadata files next to the code.
    return tfds.core.DatasetInfo(
        builder=self,
        description=__doc__.split("\n", 1)[0],
        features=tfds.features.FeaturesDict({
            "uid": tfds.features.Text(),
            "example": tfds.features.Text(),  # Example.to_json()
        }),
        disable_shuffling=True,
        metadata=tfds.core.MetadataDict(),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    c = self.builder_config
    if c.records:
      splits, counts = record_splits(c.domain, json.loads(c.records), c.seed)
      self.info.metadata["record_counts"] = counts
      return {split: self._generate_examples(exs) for split, exs in splits.items()}
    task = get_task(c.task or c.domain, domain=c.domain, **json.loads(c.options or "{}"))
    seen: set = set()
    problems: set = set()
    out = {}
    for k, (split, n) in enumerate(zip(SPLITS, (c.num_train, c.num_validation, c.num_test))):
      examples = task.generate(3 * c.seed + k, n, exclude=seen, exclude_problems=problems)
      seen.update(ex.prompt for ex in examples)
      problems.update(task.problem_key(ex) for ex in examples)
      out[split] = self._generate_examples(examples)
    return out

  def _generate_examples(self, examples):
    for i, ex in enumerate(examples):
      yield i, {"uid": ex.uid, "example": ex.to_json()}


def record_splits(domain: str, settings: dict, seed: int) -> tuple:
  """({split: [Example]}, counts) of a record domain (`records_settings`); DataError names
  the file and line of a bad record."""
  from mopd_jax.io.tokenizer import load_tokenizer  # pylint: disable=g-import-not-at-top
  from mopd_jax.config.tokenizer_options import TokenizerOptions  # pylint: disable=g-import-not-at-top
  s = settings
  options = (TokenizerOptions.from_json(s["tokenizer_options"]) if s["tokenizer"] else
             TokenizerOptions())
  tok = load_tokenizer(s["tokenizer"] or "char", efforts=s["efforts"], options=options)
  train, test, counts = recs_mod.load_domain(s["train"], s["test"], s["verifier"])
  # Validation: records held out of train by a permutation of the seed (at most a tenth).
  n_val = min(s["validation"], len(train) // 10)
  order = base.rng_for(seed, 11).permutation(len(train))
  held = set(order[:n_val].tolist())
  parts = {"train": [r for i, r in enumerate(train) if i not in held],
           "validation": [r for i, r in enumerate(train) if i in held], "test": test}
  longest = lambda text: max(len(tok.encode_prompt(text, e)) for e in s["efforts"])
  out, info = {}, counts.to_json()
  for split, recs in parts.items():
    exs, c = recs_mod.examples(recs, domain, s["verifier"], budget_source=s["budget_source"],
                               tok=tok, prompt_tokens=longest,
                               max_prompt_tokens=s["max_prompt_tokens"],
                               on_too_long=s["on_too_long"])
    if not exs:
      raise base.DataError(f"{s['train'] if split != 'test' else s['test']}: no {split} "
                           f"example of domain {domain!r} is left ({dataclasses.asdict(c)})")
    out[split] = exs
    info[split] = dataclasses.asdict(c)
  info["b0"] = {split: budgets.distribution(ex.b0 for ex in exs) for split, exs in out.items()}
  return out, info


def record_counts(builder) -> dict:
  """What a record domain's builder kept, dropped and skipped (its metadata)."""
  return dict(builder.info.metadata.get("record_counts", {}))


def make_builder(domain: str, data_dir: str, seed: int = 0,
                 *, sizes: Sequence[int] | None = None, task: str = "",
                 records: str = "", options: str = "") -> MopdTasks:
  config = make_config(domain, seed, sizes, task=task, records=records, options=options)
  # tfds refuses a config object that shares a registered config's name: pass the name then.
  registered = {c.name for c in MopdTasks.BUILDER_CONFIGS}
  return MopdTasks(data_dir=str(data_dir),
                   config=config.name if config.name in registered else config,
                   file_format=FILE_FORMAT)


def prepare(domain: str, data_dir: str, seed: int = 0,
            *, sizes: Sequence[int] | None = None, task: str = "", records: str = "",
            options: str = "") -> MopdTasks:
  """Builds the dataset into `data_dir` unless it is already there; returns the builder."""
  builder = make_builder(domain, data_dir, seed, sizes=sizes, task=task, records=records,
                         options=options)
  builder.download_and_prepare(file_format=FILE_FORMAT)
  return builder


def _to_example(item: Any) -> base.Example:
  if isinstance(item, base.Example):
    return item
  if isinstance(item, dict):
    item = item["example"]
  if isinstance(item, np.ndarray):
    item = item.item()
  return base.Example.from_json(item)


class ExampleSource:
  """Random access to the `Example`s of a data source (e.g. TFDS `as_data_source()[split]`)."""

  def __init__(self, data_source):
    self._source = data_source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> base.Example:
    return _to_example(self._source[int(i)])

  def __getitems__(self, indices: Sequence[int]) -> list:
    idx = [int(i) for i in indices]
    if hasattr(self._source, "__getitems__"):
      return [_to_example(x) for x in self._source.__getitems__(idx)]
    return [_to_example(self._source[i]) for i in idx]

  def __repr__(self):
    return f"ExampleSource({self._source!r}, len={len(self)})"


def load_split(domain: str, split: str, data_dir: str, *, seed: int = 0,
               sizes: Sequence[int] | None = None, task: str = "",
               records: str = "", options: str = "") -> ExampleSource:
  """Random-access `Example`s of one split, building the dataset first if needed."""
  if split not in SPLITS:
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
  builder = prepare(domain, data_dir, seed, sizes=sizes, task=task, records=records,
                    options=options)
  return ExampleSource(builder.as_data_source(split=split))


class ResumableIterator:
  """Batches of `Example`s in a deterministic order whose position can be saved exactly.

  The stream is epoch 0, epoch 1, ... concatenated; epoch e visits every index once, in the
  order `permutation(seed, e)` (or 0..n-1 when `shuffle=False`). A batch may straddle two
  epochs, so every batch is full. With `num_epochs` set the stream ends after that many epochs
  and the last batch may be short. `state()` is a JSON-serialisable dict; `restore(state)` on
  an iterator over the same source, batch size and seed continues with exactly the batches the
  saved one would have produced.
  """

  def __init__(self, source, batch_size: int, seed: int, *, shuffle: bool = True,
               num_epochs: int | None = None):
    if not (isinstance(batch_size, int) and batch_size > 0):
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if num_epochs is not None and not (isinstance(num_epochs, int) and num_epochs > 0):
      raise ValueError(f"num_epochs must be None or a positive int, got {num_epochs!r}")
    self._source = source
    self._n = len(source)
    if self._n == 0:
      raise ValueError("cannot iterate over an empty data source")
    self.batch_size, self.seed, self.shuffle, self.num_epochs = batch_size, seed, shuffle, \
        num_epochs
    self._epoch, self._pos = 0, 0
    self._order_cache = (None, None)

  def _order(self, epoch: int) -> np.ndarray:
    if self._order_cache[0] != epoch:
      if self.shuffle:
        order = base.rng_for(self.seed, 7, epoch).permutation(self._n)
      else:
        order = np.arange(self._n)
      self._order_cache = (epoch, order)
    return self._order_cache[1]

  def __iter__(self):
    return self

  def __next__(self) -> list:
    idx = []
    while len(idx) < self.batch_size:
      if self.num_epochs is not None and self._epoch >= self.num_epochs:
        break
      take = min(self.batch_size - len(idx), self._n - self._pos)
      idx.extend(self._order(self._epoch)[self._pos:self._pos + take].tolist())
      self._pos += take
      if self._pos == self._n:
        self._epoch, self._pos = self._epoch + 1, 0
    if not idx:
      raise StopIteration
    if hasattr(self._source, "__getitems__"):
      return list(self._source.__getitems__(idx))
    return [self._source[i] for i in idx]

  def state(self) -> dict:
    return dict(epoch=self._epoch, position=self._pos, seed=self.seed, shuffle=self.shuffle,
                batch_size=self.batch_size, num_examples=self._n)

  def restore(self, state: dict) -> None:
    """Continues from a `state()`; ValueError if it belongs to a different stream."""
    if isinstance(state, (str, bytes)):
      state = json.loads(state)
    for key in ("seed", "shuffle", "num_examples"):
      if key in state and state[key] != getattr(self, "_n" if key == "num_examples" else key):
        raise ValueError(f"state has {key}={state[key]!r}, this iterator has "
                         f"{getattr(self, '_n' if key == 'num_examples' else key)!r}")
    epoch, pos = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= pos < self._n:
      raise ValueError(f"bad iterator state {state!r}")
    self._epoch, self._pos = epoch, pos


class _JsonSource:
  """The examples of a source as their JSON strings: what grain reads and processes
  exchange."""

  def __init__(self, source):
    self._source = source

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i):
    return self._source[int(i)].to_json()

  def __repr__(self):  # what grain checks a restored state against: the same stream
    return f"examples(n={len(self._source)})"


class GrainIterator:
  """Global batches of `Example`s read by grain, each process from its own shard (see the
  module docstring); the `ResumableIterator` interface (`next`, `state`, `restore`)."""

  def __init__(self, source, batch_size: int, seed: int):
    import grain  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    processes = jax.process_count()
    if not (isinstance(batch_size, int) and batch_size > 0 and batch_size % processes == 0):
      raise ValueError(f"batch_size must be a positive multiple of the {processes} "
                       f"process(es), got {batch_size!r}")
    if len(source) < processes:
      raise ValueError(f"{len(source)} examples cannot be sharded over {processes} processes")
    self.batch_size, self.seed, self._n = batch_size, seed, len(source)
    self._local = batch_size // processes
    self._loader = grain.DataLoader(
        data_source=_JsonSource(source),
        sampler=grain.samplers.IndexSampler(
            len(source), grain.sharding.ShardByJaxProcess(drop_remainder=True), shuffle=True,
            num_epochs=None, seed=seed),
        worker_count=0)
    self._it = iter(self._loader)

  def __iter__(self):
    return self

  def __next__(self) -> list:
    from mopd_jax.runtime import distributed  # pylint: disable=g-import-not-at-top
    local = [next(self._it) for _ in range(self._local)]
    return [base.Example.from_json(t) for t in distributed.allgather_texts(local)]

  def state(self) -> dict:
    """JSON-serialisable: every process's grain state, in process order."""
    from mopd_jax.runtime import distributed  # pylint: disable=g-import-not-at-top
    mine = self._it.get_state()
    mine = mine.decode() if isinstance(mine, bytes) else json.dumps(mine)
    return dict(grain=distributed.allgather_texts([mine]), seed=self.seed,
                batch_size=self.batch_size, num_examples=self._n)

  def restore(self, state: dict) -> None:
    """Continues from a `state()` of the same stream and process count."""
    import jax  # pylint: disable=g-import-not-at-top
    if isinstance(state, (str, bytes)):
      state = json.loads(state)
    for key, mine in (("seed", self.seed), ("batch_size", self.batch_size),
                      ("num_examples", self._n)):
      if state.get(key) != mine:
        raise ValueError(f"state has {key}={state.get(key)!r}, this iterator has {mine!r}")
    states = state.get("grain") or []
    if len(states) != jax.process_count():
      raise ValueError(f"the state was saved by {len(states)} process(es); this run has "
                       f"{jax.process_count()} (each process resumes its own shard)")
    self._it.set_state(states[jax.process_index()].encode())
