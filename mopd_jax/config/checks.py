"""The checkers of the run config's fields: each is called as `check(name, value)` and
returns the value, typed, or raises ValueError naming the field, the value and what is
allowed. A leaf module: it imports only the leaf modules `choices` and `endpoints`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import ml_collections

from mopd_jax.config import choices, endpoints


@dataclasses.dataclass(frozen=True)
class Int:
  lo: int = 1

  def __call__(self, name: str, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < self.lo:
      raise ValueError(f"{name} must be an int >= {self.lo}, got {v!r}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class Num:
  lo: float = 0.0
  strict: bool = False

  def __call__(self, name: str, v):
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and
          (v > self.lo if self.strict else v >= self.lo))
    if not ok:
      raise ValueError(f"{name} must be a finite number {'>' if self.strict else '>='} "
                       f"{self.lo}, got {v!r}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class OneOf:
  values: tuple

  def __call__(self, name: str, v):
    if isinstance(v, bool) or v not in self.values:
      raise ValueError(f"{name}={v!r}; expected one of {self.values}")
    return v


@dataclasses.dataclass(frozen=True)
class Str:
  def __call__(self, name: str, v):
    if not isinstance(v, str):
      raise ValueError(f"{name} must be a string, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class DirPattern:
  """A directory path in which `{workdir}` stands for the run's workdir, or "" (off)."""

  def __call__(self, name: str, v):
    v = Str()(name, v)
    try:
      v.format(workdir="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(f"{name} may name only {{workdir}} in braces, got {v!r} ({e!r})") \
          from None
    return v


@dataclasses.dataclass(frozen=True)
class Bool:
  def __call__(self, name: str, v):
    if not isinstance(v, bool):
      raise ValueError(f"{name} must be True or False, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class Seq:
  """A tuple of `item`-checked values; `length` None = any length."""
  item: Any
  length: Optional[int] = None

  def __call__(self, name: str, v):
    if isinstance(v, (str, bytes)) or not isinstance(v, (tuple, list)):
      raise ValueError(f"{name} must be a tuple, got {v!r}")
    if self.length is not None and len(v) != self.length:
      raise ValueError(f"{name} must have {self.length} entries, got {tuple(v)!r}")
    return tuple(self.item(f"{name}[{i}]", x) for i, x in enumerate(v))


@dataclasses.dataclass(frozen=True)
class Sizes:
  """A mapping of mesh axis names to sizes >= 1."""
  axes: tuple = choices.MESH_AXES

  def __call__(self, name: str, v):
    d = dict(v or {})
    unknown = sorted(set(d) - set(self.axes))
    if unknown:
      raise ValueError(f"{name} names unknown mesh axes {unknown}; known: {self.axes}")
    return {a: Int()(f"{name}.{a}", s) for a, s in d.items()}


@dataclasses.dataclass(frozen=True)
class Raw:
  """Checked elsewhere (a resolver of RunConfig or the module that owns the value)."""

  def __call__(self, name: str, v):
    return v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v


@dataclasses.dataclass(frozen=True)
class HfPaths:
  """"domain/effort" -> a path (`what`: a checkpoint directory, a tokenizer file): the string
  "gen/low=DIR,gen/max=DIR" (what a config file or a flag sets) or a mapping; "" = none.
  Checked against the grid by build."""
  what: str = "checkpoint directory"
  form: str = "domain/effort=directory"

  def __call__(self, name: str, v):
    if isinstance(v, str):
      return endpoints.cell_items(name, v, self.form)
    if not isinstance(v, (Mapping, ml_collections.ConfigDict)):
      raise ValueError(f"{name} must map 'domain/effort' to a {self.what} "
                       f"('gen/low=PATH,gen/max=PATH'), got {v!r}")
    return {k: Str()(f"{name}[{k!r}]", p) for k, p in dict(v).items()}


@dataclasses.dataclass(frozen=True)
class Endpoints:
  """"domain/effort" -> teacher server URLs: the string
  "gen/low=http://h1:8000|http://h2:8000,gen/max=http://h3:8000" or a mapping of a cell to a
  URL or a list of them; "" = none. Checked against the grid by build."""

  def __call__(self, name: str, v):
    if isinstance(v, ml_collections.ConfigDict):
      v = v.to_dict()
    return endpoints.parse_endpoints(v)


def field(check):
  """A dataclass field whose value the block builder checks with `check(name, value)`."""
  return dataclasses.field(metadata={"check": check})
