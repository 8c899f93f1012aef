"""The run's task grid: which domains and which effort levels, as data.

A run names its domains and efforts in its config, comma-separated:

    c.domains = "gen,agt,cod"      # each a block of c.tasks (or a registered task's name)
    c.efforts = "low,high,max"     # each a block of c.effort holding its tau
    c.tasks.gen.task = "gen"       # the registered task a domain runs (mopd_jax.tasks)
    c.effort.max.tau = 1.5         # budget multiplier: floor(tau * b0(x)) tokens

so `--config.domains=gen,cod --config.efforts=low,max` trains 2 x 2 teachers. There is one
teacher per (domain, effort) cell, named "domain/effort"; cells are domain-major, efforts in
the config's order. The RL lanes anneal each domain's efforts from the largest tau down
(`anneal_order`), and the report orders efforts by tau, shortest budget first.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Sequence

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def split_names(spec, what: str) -> tuple:
  """"a,b,c" (or a sequence of names) -> ("a", "b", "c"); ValueError on an empty or
  repeated name."""
  names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else \
      [str(s).strip() for s in spec]
  names = [n for n in names if n]
  if not names:
    raise ValueError(f"{what} names no entry; give comma-separated names, e.g. 'gen,cod'")
  if len(set(names)) != len(names):
    raise ValueError(f"{what}={','.join(names)!r} repeats a name")
  for n in names:
    if not _NAME.match(n):
      raise ValueError(f"{what}: {n!r} is not a valid name (a letter, then letters, digits "
                       "or _)")
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class Effort:
  name: str
  tau: float

  def __post_init__(self):
    if not _NAME.match(self.name):
      raise ValueError(f"effort name {self.name!r} must be a letter, then letters, digits or _")
    t = self.tau
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
      raise ValueError(f"effort {self.name}: tau must be a finite number > 0, got {t!r}")


@dataclasses.dataclass(frozen=True)
class Grid:
  """Domains (each with the registered task it runs) x efforts (each with its tau)."""

  domains: tuple  # domain names, in the config's order
  efforts: tuple  # Effort, in the config's order
  tasks: tuple = ()  # the registered task of each domain; () = the domain names themselves

  def __post_init__(self):
    split_names(self.domains, "domains")
    split_names([e.name for e in self.efforts], "efforts")
    if not self.tasks:  # each domain runs the task of its own name
      object.__setattr__(self, "tasks", tuple(self.domains))
    if len(self.tasks) != len(self.domains):
      raise ValueError(f"{len(self.domains)} domains but {len(self.tasks)} task names")
    taus = [e.tau for e in self.efforts]
    if len(set(taus)) != len(taus):
      raise ValueError(f"effort taus must differ (each effort is its own budget), got "
                       f"{self.taus}")

  @property
  def effort_names(self) -> tuple:
    return tuple(e.name for e in self.efforts)

  @property
  def taus(self) -> dict:
    return {e.name: e.tau for e in self.efforts}

  def task_of(self, domain: str) -> str:
    return dict(zip(self.domains, self.tasks))[domain]

  @property
  def anneal_order(self) -> tuple:
    """Effort names from the largest tau down: the order an RL lane trains them in."""
    return tuple(e.name for e in sorted(self.efforts, key=lambda e: -e.tau))

  @property
  def by_budget(self) -> tuple:
    """Effort names from the smallest tau up (tables' and checks' length order)."""
    return self.anneal_order[::-1]

  @property
  def top_effort(self) -> str:
    return self.anneal_order[0]

  @property
  def cells(self) -> list:
    return [(d, e) for d in self.domains for e in self.effort_names]

  @property
  def names(self) -> tuple:
    """Teacher names "domain/effort", domain-major."""
    return tuple(f"{d}/{e}" for d, e in self.cells)

  def to_json(self) -> dict:
    # Efforts as [name, tau] pairs: their order is part of the grid (JSON objects are not
    # ordered once written with sorted keys).
    return {"domains": list(self.domains), "tasks": list(self.tasks),
            "efforts": [[e.name, e.tau] for e in self.efforts]}

  @classmethod
  def from_json(cls, d: Mapping) -> "Grid":
    efforts = d["efforts"]
    pairs = efforts.items() if isinstance(efforts, Mapping) else efforts
    return cls(tuple(d["domains"]), tuple(Effort(n, float(t)) for n, t in pairs),
               tuple(d.get("tasks") or ()))

  def describe(self) -> str:
    return (f"{len(self.domains)} x {len(self.efforts)} grid: domains "
            f"{','.join(self.domains)}; efforts " +
            ",".join(f"{e.name} (tau {e.tau:g})" for e in self.efforts))


def from_config(config, known_tasks: Sequence[str]) -> Grid:
  """The grid of a run config: `domains` / `efforts` name blocks of `tasks` / `effort`.

  A domain needs a `tasks.<name>` block or must itself be a registered task (`known_tasks`);
  an effort needs an `effort.<name>` block with a `tau`. Unknown names raise ValueError
  listing the known ones (before anything is compiled)."""
  domains = split_names(config.domains, "domains")
  efforts = split_names(config.efforts, "efforts")
  blocks = dict(config.tasks or {})
  known_domains = sorted(set(blocks) | set(known_tasks))
  unknown = [d for d in domains if d not in known_domains]
  if unknown:
    raise ValueError(f"unknown domain(s) {unknown} in domains={','.join(domains)!r}; known: "
                     f"{known_domains} (a domain is a block of config.tasks or a registered "
                     "task)")
  tasks = []
  for d in domains:
    task = (blocks.get(d) or {}).get("task", d)
    if task not in known_tasks:
      raise ValueError(f"tasks.{d}.task={task!r} is not a registered task; known: "
                       f"{sorted(known_tasks)}")
    tasks.append(task)
  levels = dict(config.effort or {})
  unknown = [e for e in efforts if e not in levels]
  if unknown:
    raise ValueError(f"unknown effort(s) {unknown} in efforts={','.join(efforts)!r}; known: "
                     f"{sorted(levels)} (an effort is a block of config.effort with a tau)")
  out = []
  for e in efforts:
    block = levels[e]
    tau = block.get("tau") if hasattr(block, "get") else None
    if tau is None:
      raise ValueError(f"effort.{e} needs a tau (effort.{e}.tau = budget multiplier)")
    out.append(Effort(e, tau))
  return Grid(domains, tuple(out), tuple(tasks))
