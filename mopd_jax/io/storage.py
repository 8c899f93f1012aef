"""Every workdir and data-dir path through one abstraction: local folders and object storage.

A pod run writes its workdir to `gs://bucket/run` (local disks vanish with the VMs and every
host must see the same files). `etils.epath` (what orbax and TFDS use) serves both: a local
path through the OS, `gs://` (and `s3://`) through fsspec. The pipeline's modules read and
write workdir files only through this module, never with `open`, `os.path`, `os.replace`,
`shutil` or `glob` (tests/test_storage.py checks the sources).

Writes are safe for readers: on a POSIX filesystem a file is written beside its target and
renamed over it (a reader sees the old or the new file, never half of one); on object storage
a single-object upload is already atomic, so it is written in place.

Files that a library must write through the OS (TensorBoard event files, a subprocess's log)
go to `LocalMirror`: a local folder copied up to the workdir at each `sync()`; with a local
workdir the mirror is the workdir folder itself, and `sync()` does nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Optional, Union

from etils import epath

PathLike = Union[str, os.PathLike, epath.Path]


def path(p: PathLike, *parts: str) -> epath.Path:
  """`p` (joined with `parts`) as an epath.Path; a local path is made absolute."""
  s = os.fspath(p)
  if not is_remote(s):
    s = os.path.abspath(s)
  return epath.Path(s).joinpath(*parts)


def is_remote(p: PathLike) -> bool:
  """Whether `p` is on object storage (a scheme like gs://), not a POSIX filesystem."""
  return "://" in os.fspath(p)


def join(p: PathLike, *parts: str) -> str:
  """`p` joined with `parts`, as a string (the form orbax and the CLI take)."""
  return os.fspath(path(p, *parts))


def exists(p: PathLike) -> bool:
  return path(p).exists()


def isdir(p: PathLike) -> bool:
  return path(p).is_dir()


def makedirs(p: PathLike) -> None:
  path(p).mkdir(parents=True, exist_ok=True)


def listdir(p: PathLike) -> list:
  q = path(p)
  return sorted(x.name for x in q.iterdir()) if q.exists() else []


def write_bytes(p: PathLike, data: bytes) -> None:
  """`data` as the whole file `p`, atomically for readers (module docstring)."""
  q = path(p)
  q.parent.mkdir(parents=True, exist_ok=True)
  if is_remote(q):
    q.write_bytes(data)
    return
  tmp = q.parent / f".{q.name}.tmp-{os.getpid()}"
  tmp.write_bytes(data)
  tmp.replace(q)


def write_text(p: PathLike, text: str) -> None:
  write_bytes(p, text.encode("utf-8"))


def read_text(p: PathLike) -> str:
  return path(p).read_text()


def write_json(p: PathLike, obj: Any) -> None:
  write_text(p, json.dumps(obj, indent=2, sort_keys=True))


def read_json(p: PathLike, default: Optional[Any] = None) -> Any:
  """The JSON file `p`; `default` when it does not exist (FileNotFoundError without one)."""
  q = path(p)
  if not q.exists():
    if default is not None:
      return default
    raise FileNotFoundError(f"missing JSON file {q}")
  return json.loads(q.read_text())


def append_text(p: PathLike, text: str) -> None:
  """Appends `text` (object storage has no append: the object is rewritten)."""
  q = path(p)
  if is_remote(q):
    old = q.read_text() if q.exists() else ""
    write_text(q, old + text)
    return
  q.parent.mkdir(parents=True, exist_ok=True)
  with q.open("a") as f:
    f.write(text)


def rename(src: PathLike, dst: PathLike) -> None:
  path(dst).parent.mkdir(parents=True, exist_ok=True)
  path(src).rename(path(dst))


def rmtree(p: PathLike) -> None:
  q = path(p)
  if q.exists():
    q.rmtree()


def copytree(src: PathLike, dst: PathLike) -> None:
  """Copies the folder `src` into `dst` (files overwritten), local or remote either side."""
  s, d = path(src), path(dst)
  for item in s.iterdir():
    if item.is_dir():
      copytree(item, d / item.name)
    else:
      d.mkdir(parents=True, exist_ok=True)
      (d / item.name).write_bytes(item.read_bytes())


class LocalMirror:
  """A local folder for files a library writes through the OS, mirrored to `target` (a
  workdir folder) at each `sync()` and at `close()`. With a local `target` the folder is
  `target` itself."""

  def __init__(self, target: PathLike):
    self.target = path(target)
    self.remote = is_remote(self.target)
    if self.remote:
      self.local = tempfile.mkdtemp(prefix="mopd_mirror_")
    else:
      self.local = os.fspath(self.target)
      os.makedirs(self.local, exist_ok=True)

  def sync(self) -> None:
    if self.remote:
      copytree(self.local, self.target)

  def close(self) -> None:
    if self.remote:
      self.sync()
      shutil.rmtree(self.local, ignore_errors=True)
