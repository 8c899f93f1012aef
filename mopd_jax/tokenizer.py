"""Tokenizers: a deterministic character-level one for the toy tasks.

Every tokenizer exposes the same small interface: `encode(text) -> list[int]`,
`decode(ids) -> str`, `vocab_size`, the special ids (`pad_id`, `bos_id`, `eos_id`), one token
per effort level (`effort_id(name)`) and the tool-call / observation markers.
"""
from __future__ import annotations

import string
from typing import Iterable

EFFORTS = ("low", "high", "max")
SPECIALS = ("<pad>", "<bos>", "<eos>", "<low>", "<high>", "<max>", "<call>", "</call>", "<obs>",
            "</obs>")
# Printable ASCII minus a few characters the toy tasks never use, plus newline.
CHARSET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + \
    "+-*/%=<>()[]{},.:;?!_'\"#&|^~"


class CharTokenizer:
  """One id per special token, then one per character of `CHARSET`."""

  def __init__(self, charset: str = CHARSET):
    if len(set(charset)) != len(charset):
      raise ValueError("charset has repeated characters")
    self._specials = {s: i for i, s in enumerate(SPECIALS)}
    self._chars = {c: i + len(SPECIALS) for i, c in enumerate(charset)}
    self._inverse = {i: s for s, i in {**self._specials, **self._chars}.items()}
    self.pad_id, self.bos_id, self.eos_id = (self._specials[s] for s in SPECIALS[:3])
    self.call_id, self.call_end_id = self._specials["<call>"], self._specials["</call>"]
    self.obs_id, self.obs_end_id = self._specials["<obs>"], self._specials["</obs>"]

  @property
  def vocab_size(self) -> int:
    return len(self._inverse)

  def effort_id(self, effort: str) -> int:
    if effort not in EFFORTS:
      raise ValueError(f"unknown effort {effort!r}; expected one of {EFFORTS}")
    return self._specials[f"<{effort}>"]

  def encode(self, text: str) -> list:
    """Characters to ids; special tokens written literally (e.g. "<call>") are recognised."""
    ids, i = [], 0
    while i < len(text):
      if text[i] == "<":
        end = text.find(">", i)
        tok = text[i:end + 1] if end >= 0 else ""
        if tok in self._specials:
          ids.append(self._specials[tok])
          i = end + 1
          continue
      if text[i] not in self._chars:
        raise ValueError(f"character {text[i]!r} at offset {i} is not in the tokenizer's charset")
      ids.append(self._chars[text[i]])
      i += 1
    return ids

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    out = []
    for i in ids:
      i = int(i)
      if i not in self._inverse:
        raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
      if skip_special and i in self._specials.values():
        continue
      out.append(self._inverse[i])
    return "".join(out)
