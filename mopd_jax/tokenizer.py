"""Tokenizers: a deterministic character-level one for the toy tasks, and `HFTokenizer`, the
same interface over a Hugging Face `tokenizers` file (`load_tokenizer` picks one by spec).

Every tokenizer exposes the same small interface: `encode(text) -> list[int]`,
`decode(ids) -> str`, `vocab_size`, the special ids (`pad_id`, `bos_id`, `eos_id`), one token
per effort level (`effort_id(name)`) and the tool-call / observation markers.

The effort tokens follow the run's efforts (`grid.Grid.effort_names`): `<name>` for each, in
the config's order, between the PAD/BOS/EOS and the tool markers. The toy's three efforts
give the ids listed in `SPECIALS`.

Prompts. `encode_prompt(text, effort)` is the one place a prompt becomes ids. The toy
layout is `<bos> text "\n" <effort>`; a Hugging Face tokenizer with a chat template renders
the prompt as a user message with the generation prompt, and the effort either as its
special token after it (`effort_format="token"`) or as a system line such as
`Reasoning effort: high` (`"system"`: no token is added to the vocabulary). `effort=None`
renders the prompt without any effort: what the teachers see (K3 eq. 15 conditions only the
student on the effort; a teacher's effort lives in its weights).
"""
from __future__ import annotations

import string
from typing import Iterable

DEFAULT_EFFORTS = ("low", "high", "max")  # the toy's efforts
_HEAD = ("<pad>", "<bos>", "<eos>")
_TOOL = ("<call>", "</call>", "<obs>", "</obs>")


def specials(efforts=DEFAULT_EFFORTS) -> tuple:
  """The special tokens of a tokenizer for these efforts, in id order."""
  return _HEAD + tuple(f"<{e}>" for e in efforts) + _TOOL


SPECIALS = specials()
# Printable ASCII minus a few characters the toy tasks never use, plus newline.
CHARSET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n" + \
    "+-*/%=<>()[]{},.:;?!_'\"#&|^~"


class CharTokenizer:
  """One id per special token, then one per character of `CHARSET`."""

  def __init__(self, charset: str = CHARSET, efforts=DEFAULT_EFFORTS):
    if len(set(charset)) != len(charset):
      raise ValueError("charset has repeated characters")
    self.efforts = _check_efforts(efforts)
    self._specials = {s: i for i, s in enumerate(specials(self.efforts))}
    self._chars = {c: i + len(self._specials) for i, c in enumerate(charset)}
    self._inverse = {i: s for s, i in {**self._specials, **self._chars}.items()}
    self.pad_id, self.bos_id, self.eos_id = (self._specials[s] for s in _HEAD)
    self.call_id, self.call_end_id = self._specials["<call>"], self._specials["</call>"]
    self.obs_id, self.obs_end_id = self._specials["<obs>"], self._specials["</obs>"]

  @property
  def vocab_size(self) -> int:
    return len(self._inverse)

  def effort_id(self, effort: str) -> int:
    if effort not in self.efforts:
      raise ValueError(f"unknown effort {effort!r}; expected one of {self.efforts}")
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

  def encode_prompt(self, text: str, effort: str | None) -> list:
    """<bos> text "\n" <effort>, or without the effort token when `effort` is None. The
    effort token comes last, so the reply's first token (where the style is chosen) is
    predicted at the effort token itself."""
    ids = [self.bos_id] + self.encode(text + "\n")
    return ids if effort is None else ids + [self.effort_id(effort)]

  def token_table(self) -> list:
    """[(id, token string)] of every id."""
    return sorted(self._inverse.items())

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


EFFORT_FORMATS = ("token", "system")


class HFTokenizer:
  """The same interface over a Hugging Face `tokenizers` `tokenizer.json`.

  The effort tokens (`<low> <high> <max>`, or `<name>` of each of `efforts`; none with
  `effort_format="system"`) and the tool markers (`<call> </call> <obs> </obs>`, or the four
  tokens of `tool_tokens`, e.g. Qwen's `<tool_call>`...) are added as special tokens (a token
  the file already has keeps its id). PAD/BOS/EOS reuse the tokens named by
  `pad_token`/`bos_token`/`eos_token` when the file has them (e.g. `"<|im_end|>"` as the EOS
  of a chat model), otherwise our `<pad> <bos> <eos>` are added. `encode` never adds BOS/EOS
  by itself (the caller places them, as with `CharTokenizer`); special tokens written
  literally in the text are recognised.

  `chat`: render prompts with the chat template of the `tokenizer_config.json` beside the
  file (when it has one); `system_line`: the system message of the "system" effort format,
  `{effort}` replaced by the effort's name.
  """

  def __init__(self, path: str, pad_token: str | None = None, bos_token: str | None = None,
               eos_token: str | None = None, efforts=DEFAULT_EFFORTS,
               effort_format: str = "token", chat: bool = True,
               system_line: str = "Reasoning effort: {effort}", tool_tokens=None):
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    path = str(path)
    if os.path.isdir(path):
      path = os.path.join(path, "tokenizer.json")
    try:
      self._tok = Tokenizer.from_file(path)
    except Exception as e:  # pylint: disable=broad-except  (the Rust error types vary)
      raise ValueError(f"cannot load tokenizer from {path!r}: {e}") from None
    self.path = path
    self.efforts = _check_efforts(efforts)
    if effort_format not in EFFORT_FORMATS:
      raise ValueError(f"effort_format={effort_format!r}; expected one of {EFFORT_FORMATS}")
    if effort_format == "system" and "{effort}" not in system_line:
      raise ValueError(f"system_line {system_line!r} must contain {{effort}}")
    self.effort_format, self.system_line = effort_format, system_line
    chosen = {"<pad>": pad_token, "<bos>": bos_token, "<eos>": eos_token}
    if tool_tokens:
      tool_tokens = tuple(tool_tokens)
      if len(tool_tokens) != 4:
        raise ValueError(f"tool_tokens must name 4 tokens (call, call end, observation, "
                         f"observation end), got {tool_tokens!r}")
      chosen.update(zip(_TOOL, tool_tokens))
    wanted = _HEAD + (tuple(f"<{e}>" for e in self.efforts)
                      if effort_format == "token" else ()) + _TOOL
    names = {}
    for ours in wanted:
      theirs = chosen.get(ours)
      if theirs is not None and self._tok.token_to_id(theirs) is None:
        raise ValueError(f"{path}: has no token {theirs!r} to use for {ours}")
      names[ours] = theirs or ours
    # Adds the missing ones; ones the file already has keep their ids and become special
    # (matched whole in the text, dropped by `decode(skip_special=True)`).
    self._tok.add_special_tokens(list(dict.fromkeys(names.values())))
    self._special_ids = {ours: self._tok.token_to_id(n) for ours, n in names.items()}
    self.pad_id, self.bos_id, self.eos_id = (self._special_ids[s] for s in _HEAD)
    self.call_id, self.call_end_id = self._special_ids["<call>"], self._special_ids["</call>"]
    self.obs_id, self.obs_end_id = self._special_ids["<obs>"], self._special_ids["</obs>"]
    self.chat_template = _read_chat_template(os.path.dirname(path))
    self.chat = bool(chat and self.chat_template)
    self._compiled = None  # the chat template, compiled on first use

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
    """Render `messages` ([{"role", "content"}]) with the checkpoint's Jinja chat template."""
    if not self.chat_template:
      raise ValueError(f"{self.path}: no chat_template in tokenizer_config.json")
    if self._compiled is None:  # compiled once: every prompt of a run is rendered with it
      import jinja2.sandbox  # pylint: disable=g-import-not-at-top
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      self._compiled = env.from_string(self.chat_template)
    return self._compiled.render(messages=messages,
                                 add_generation_prompt=add_generation_prompt, **kwargs)

  def effort_id(self, effort: str) -> int:
    if effort not in self.efforts:
      raise ValueError(f"unknown effort {effort!r}; expected one of {self.efforts}")
    if self.effort_format != "token":
      raise ValueError(f"effort_format={self.effort_format!r}: the effort is a system line, "
                       "not a token")
    return self._special_ids[f"<{effort}>"]

  def encode_prompt(self, text: str, effort: str | None) -> list:
    """The prompt's ids: by the chat template (a user message, the generation prompt; the
    effort as a system line or as its token after the generation prompt), else the toy
    layout `<bos> text "\n" <effort>`. `effort=None`: no effort at all."""
    if effort is not None and effort not in self.efforts:
      raise ValueError(f"unknown effort {effort!r}; expected one of {self.efforts}")
    token = [] if effort is None or self.effort_format != "token" else [self.effort_id(effort)]
    if not self.chat:
      if effort is not None and self.effort_format == "system":
        text = self.system_line.format(effort=effort) + "\n" + text
      return [self.bos_id] + self.encode(text + "\n") + token
    messages = [{"role": "user", "content": text}]
    if effort is not None and self.effort_format == "system":
      messages.insert(0, {"role": "system",
                          "content": self.system_line.format(effort=effort)})
    return self.encode(self.apply_chat_template(messages)) + token

  def encode(self, text: str) -> list:
    if not isinstance(text, str):
      raise ValueError(f"encode expects str, got {type(text).__name__}")
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"text is not valid UTF-8: {e}") from None
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def token_table(self) -> list:
    """[(id, token string)] of every id: the file's vocabulary with the added specials."""
    return sorted((i, t) for t, i in self._tok.get_vocab(with_added_tokens=True).items())

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    ids = [int(i) for i in ids]
    n = self.vocab_size
    for i in ids:
      if not 0 <= i < n:
        raise ValueError(f"token id {i} outside the vocabulary [0, {n})")
    return self._tok.decode(ids, skip_special_tokens=skip_special)


def _read_chat_template(folder: str):
  """The `chat_template` of a `tokenizer_config.json` beside the tokenizer, or None."""
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  cfg_path = os.path.join(folder, "tokenizer_config.json")
  if not os.path.isfile(cfg_path):
    return None
  try:
    with open(cfg_path, encoding="utf-8") as f:
      template = json.load(f).get("chat_template")
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read {cfg_path}: {e}") from None
  if isinstance(template, list):  # several named templates: take "default"
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  return template


def _check_efforts(efforts) -> tuple:
  efforts = tuple(efforts)
  if not efforts or len(set(efforts)) != len(efforts) or not all(
      isinstance(e, str) and e.isidentifier() for e in efforts):
    raise ValueError(f"efforts must be distinct identifier-like names, got {efforts!r}")
  clash = [e for e in efforts if f"<{e}>" in _HEAD + _TOOL]
  if clash:
    raise ValueError(f"effort name(s) {clash} clash with the tokenizer's own special tokens")
  return efforts


def load_tokenizer(spec: str = "char", efforts=DEFAULT_EFFORTS, **kwargs):
  """`"char"` -> `CharTokenizer(efforts=efforts)` (the HF options `kwargs` do not apply to
  it); a path to a `tokenizer.json` (or a folder holding one) -> `HFTokenizer(path,
  efforts=efforts, **kwargs)`. ValueError for anything else."""
  import os  # pylint: disable=g-import-not-at-top
  if spec == "char":
    return CharTokenizer(efforts=efforts)
  if isinstance(spec, str) and (os.path.isfile(spec) or
                                os.path.isfile(os.path.join(spec, "tokenizer.json"))):
    return HFTokenizer(spec, efforts=efforts, **kwargs)
  raise ValueError(f"unknown tokenizer {spec!r}: expected 'char' or a path to a tokenizer.json")


_SPECIAL_ATTRS = ("pad_id", "bos_id", "eos_id", "call_id", "call_end_id", "obs_id", "obs_end_id")


def fingerprint(tok) -> str:
  """A hex digest of what a token id means to `tok`: every id's token string, the special
  ids and the effort tokens. Two processes exchanging token ids (a trainer and a teacher
  server) agree on the ids' meaning exactly when their fingerprints are equal."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  table = tok.token_table()
  efforts = {e: (tok.effort_id(e) if getattr(tok, "effort_format", "token") == "token"
                 else None) for e in tok.efforts}
  blob = json.dumps({"table": table, "specials": {a: getattr(tok, a) for a in _SPECIAL_ATTRS},
                     "efforts": efforts}, sort_keys=True, ensure_ascii=True)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]
