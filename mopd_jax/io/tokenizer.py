"""Tokenizers: a deterministic character-level one for the toy tasks, and `HFTokenizer`, the
same interface over a Hugging Face `tokenizers` file (`load_tokenizer` picks one by spec).

Every tokenizer exposes the same small interface: `encode(text) -> list[int]`,
`decode(ids) -> str`, `vocab_size`, the special ids (`pad_id`, `bos_id`, `eos_id`), one token
per effort level (`effort_id(name)`) and the tool-call / observation markers.

The effort tokens follow the run's efforts (`grid.Grid.effort_names`): `<name>` for each, in
the config's order, between the PAD/BOS/EOS and the tool markers. The toy's three efforts
give the ids listed in `SPECIALS`.

Prompts. `encode_prompt(text, effort)` is the one place a prompt becomes ids. The toy
layout is `<bos> <effort> text "\n"` (the effort first, so the text is at the same offsets
from the reply with or without it); a Hugging Face tokenizer with a chat template renders
the prompt as a user message with the generation prompt, and the effort as its special token
after it (`effort_format="token"`), as a system line such as `Reasoning effort: high`
("system"), or as that line at the start of the user's turn ("user", for templates with no
system role); "auto" picks "system" or "user" by what the template renders. `effort=None`
renders the prompt without any effort: what the teachers see (K3 eq. 15 conditions only the
student on the effort; a teacher's effort lives in its weights).

The special tokens of a Hugging Face tokenizer come from the config when it names them, else
from the tokenizer's own files (mopd_jax/io/tokenizer_files.py), and the tool markers only when
a domain of the run uses tools (`HFTokenizer`).
"""
from __future__ import annotations

import string
from typing import Iterable

from mopd_jax.config import choices
from mopd_jax.config.tokenizer_options import TokenizerOptions, TOOL_MARKERS

DEFAULT_EFFORTS = ("low", "high", "max")  # the toy's efforts
_HEAD = ("<pad>", "<bos>", "<eos>")
_TOOL = TOOL_MARKERS


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
    """<bos> <effort> text "\n", or without the effort token when `effort` is None. The
    effort token comes first, so the text stands at the same offsets from the reply with
    and without it: what a model learns to copy from a prompt with an effort (a name at a
    fixed place) it also finds in the teachers' effort-free prompts."""
    head = [self.bos_id] if effort is None else [self.bos_id, self.effort_id(effort)]
    return head + self.encode(text + "\n")

  def token_table(self) -> list:
    """[(id, token string)] of every id."""
    return sorted(self._inverse.items())

  def token_bytes(self, ids: Iterable[int]) -> list:
    """Each token's bytes of the text it stands for: a character's UTF-8, b"" for a
    special token (it joins the span it ends, `mopd_jax/teachers/alignment.py`)."""
    specials = set(self._specials.values())
    return [b"" if int(i) in specials else self._inverse[int(i)].encode("utf-8") for i in ids]

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


EFFORT_FORMATS = choices.EFFORT_FORMATS
_ROLE_OF = {"<pad>": "pad", "<bos>": "bos", "<eos>": "eos"}


class HFTokenizer:
  """The same interface over a Hugging Face `tokenizers` `tokenizer.json`; the fields of
  `options` (a `TokenizerOptions`, built by `config.RunConfig.tokenizer_options`) are the
  settings named below.

  Special tokens. PAD/BOS/EOS are the tokens named by `pad_token`/`bos_token`/`eos_token`
  (the config) when given; else the ones the tokenizer's own files name
  (mopd_jax/io/tokenizer_files.py: tokenizer_config.json, special_tokens_map.json,
  generation_config.json), except that with a chat template the end of a response is the
  special token the template writes after an assistant's reply (`<|im_end|>`, `<|eot_id|>`,
  `<end_of_turn>`, `</s>`); a role no file names gets our `<pad>`/`<bos>`/`<eos>`, added. A
  chat template whose assistant turn ends with no special token of the file is an error: the
  run would not know where a response ends.

  Tool markers. `tools`: the four markers (call, call end, observation, observation end) the
  run's data writes, or () when no domain of the run uses tools (then `call_id`,
  `call_end_id`, `obs_id`, `obs_end_id` are None and nothing is added). The markers are the
  tokenizer's own when it has them, else added; `tool_tokens` (four existing tokens) replaces
  them. One log line says which.

  The effort tokens (`<name>` of each of `efforts`) are added with `effort_format="token"`.
  Added tokens, and existing ones used for a role, become special (matched whole in the text,
  dropped by `decode(skip_special=True)`); an existing token keeps its id. `encode` never
  adds BOS/EOS by itself (the caller places them, as with `CharTokenizer`).

  `chat`: render prompts with the chat template of the files (when there is one).
  `effort_format`: where the student's effort goes; "token" (its special token after the
  generation prompt), "system" (a system message, `system_line` with `{effort}` replaced by
  the effort's name), "user" (that line at the start of the user's turn) or "auto": "system"
  when the template renders a system message, else "user". Without a chat template "system",
  "user" and "auto" put the line before the prompt's text.
  """

  def __init__(self, path: str, options: TokenizerOptions = TokenizerOptions(),
               efforts=DEFAULT_EFFORTS):
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    import os  # pylint: disable=g-import-not-at-top
    from mopd_jax.io import tokenizer_files  # pylint: disable=g-import-not-at-top
    pad_token, bos_token, eos_token = options.pad_token, options.bos_token, options.eos_token
    effort_format, chat, system_line = options.effort_format, options.chat, options.system_line
    tool_tokens, tools = options.tool_tokens, options.tools
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
    if effort_format != "token" and "{effort}" not in system_line:
      raise ValueError(f"system_line {system_line!r} must contain {{effort}}")
    self.system_line = system_line
    self.files = tokenizer_files.TokenizerFiles(os.path.dirname(path))
    self.chat_template = self.files.chat_template
    self.chat = bool(chat and self.chat_template)
    if self.chat:
      why = self.files.user_turn_error()
      if why is not None:
        raise ValueError(why)
    self.effort_format = self._effort_format(effort_format)
    tools = tuple(tools or ())
    if tools and tool_tokens:
      tools = tuple(tool_tokens)
    if tools and len(tools) != 4:
      raise ValueError(f"tool_tokens must name 4 tokens (call, call end, observation, "
                       f"observation end), got {tools!r}")
    names = {ours: self._special_name(ours, given) for ours, given in
             (("<pad>", pad_token), ("<bos>", bos_token), ("<eos>", eos_token))}
    if effort_format == "token":
      names.update((f"<{e}>", f"<{e}>") for e in self.efforts)
    if tools:
      if tool_tokens:
        for t in tools:
          if self._tok.token_to_id(t) is None:
            raise ValueError(f"{path}: has no token {t!r} to use as a tool marker")
      missing = [t for t in tools if self._tok.token_to_id(t) is None]
      names.update(zip(_TOOL, tools))
    # Adds the missing ones; ones the file already has keep their ids and become special
    # (matched whole in the text, dropped by `decode(skip_special=True)`).
    self._tok.add_special_tokens(list(dict.fromkeys(names.values())))
    self._special_ids = {ours: self._tok.token_to_id(n) for ours, n in names.items()}
    self.pad_id, self.bos_id, self.eos_id = (self._special_ids[s] for s in _HEAD)
    self.call_id, self.call_end_id, self.obs_id, self.obs_end_id = (
        (self._special_ids[s] for s in _TOOL) if tools else (None,) * 4)
    from absl import logging  # pylint: disable=g-import-not-at-top
    logging.info("%s: end of response %r, padding %r, BOS %r; the student's effort: %s", path,
                 names["<eos>"], names["<pad>"], names["<bos>"], self.effort_format)
    if tools:
      logging.info("%s: tool markers %s %s", path, " ".join(tools),
                   "named by prompt.tool_tokens" if tool_tokens else
                   f"added to the vocabulary ({', '.join(missing)})" if missing else
                   "taken from the tokenizer")

  def _effort_format(self, requested: str) -> str:
    """The effort's form: the requested one, "auto" resolved by the chat template."""
    if requested == "token":
      return requested
    if not self.chat:
      return "system"  # a text line before the prompt
    if requested == "auto":
      return "system" if self.files.takes_system() else "user"
    if requested == "system" and not self.files.takes_system():
      raise ValueError(f"{self.files.template_path}: the chat template does not render a "
                       "system message; set prompt.effort_format='user' (or 'auto') to put "
                       "the effort at the start of the user's turn")
    return requested

  def _special_name(self, ours: str, given: str | None) -> str:
    """The token used as `ours` (<pad> <bos> <eos>): the config's, else the files' (for
    <eos> with a chat template: the template's end of turn), else `ours` (added)."""
    if given:
      if self._tok.token_to_id(given) is None:
        raise ValueError(f"{self.path}: has no token {given!r} to use for {ours}")
      return given
    role = _ROLE_OF[ours]
    if role == "eos" and self.chat:
      return self._end_of_turn()
    named = self.files.special(role)
    if named is None:
      return ours
    token, where = named
    text = self._tok.id_to_token(token) if isinstance(token, int) else token
    if text is None or self._tok.token_to_id(text) is None:
      raise ValueError(f"{where}: names {token!r} as the {role} token, which {self.path} "
                       "does not have")
    return text

  def _end_of_turn(self) -> str:
    """The special token the chat template writes right after an assistant's reply."""
    after = self.files.after_reply()
    where = self.files.template_path
    if after is None:
      raise ValueError(f"{where}: the chat template cannot render an assistant turn, so the "
                       "end of a response is unknown; name it with prompt.eos_token")
    ids = self._tok.encode(after, add_special_tokens=False).ids if after else []
    added = self._tok.get_added_tokens_decoder()
    if not ids or ids[0] not in added or not added[ids[0]].special:
      raise ValueError(f"{where}: the chat template ends an assistant turn with {after[:24]!r}, "
                       f"not with a special token of {self.path}: the tokenizer has no "
                       "end-of-turn token; name one with prompt.eos_token")
    return added[ids[0]].content

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
    """Render `messages` ([{"role", "content"}]) with the checkpoint's Jinja chat template,
    as transformers renders it (mopd_jax/io/tokenizer_files.py)."""
    return self.files.render(messages, add_generation_prompt, **kwargs)

  def effort_id(self, effort: str) -> int:
    if effort not in self.efforts:
      raise ValueError(f"unknown effort {effort!r}; expected one of {self.efforts}")
    if self.effort_format != "token":
      raise ValueError(f"effort_format={self.effort_format!r}: the effort is a text line, "
                       "not a token")
    return self._special_ids[f"<{effort}>"]

  def encode_prompt(self, text: str, effort: str | None) -> list:
    """The prompt's ids: by the chat template (a user message, the generation prompt; the
    effort as a system message, at the start of the user's turn, or as its token after the
    generation prompt), else the toy layout `<bos> <effort> text "\n"`. `effort=None`: no
    effort at all."""
    if effort is not None and effort not in self.efforts:
      raise ValueError(f"unknown effort {effort!r}; expected one of {self.efforts}")
    token = [] if effort is None or self.effort_format != "token" else [self.effort_id(effort)]
    if not self.chat:
      if effort is not None and self.effort_format == "system":
        text = self.system_line.format(effort=effort) + "\n" + text
      return [self.bos_id] + token + self.encode(text + "\n")
    messages = [{"role": "user", "content": text}]
    line = None if effort is None else self.system_line.format(effort=effort)
    if line is not None and self.effort_format == "system":
      messages.insert(0, {"role": "system", "content": line})
    elif line is not None and self.effort_format == "user":
      messages[0]["content"] = line + "\n\n" + text
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

  def token_bytes(self, ids: Iterable[int]) -> list:
    """Each token's bytes of the text it stands for, b"" for a special token: exact for a
    byte-level BPE (GPT-2, Llama 3, Qwen: the token string read through the byte alphabet);
    for other decoders each token decoded alone (which may not reproduce the text: the
    alignment then refuses the row)."""
    from tokenizers import decoders  # pylint: disable=g-import-not-at-top
    special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
    out = []
    for i in (int(i) for i in ids):
      if i in special:
        out.append(b"")
      elif byte_level:
        out.append(bytes(_BYTE_OF[c] for c in self._tok.id_to_token(i)))
      else:
        out.append(self._tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return out

  def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
    ids = [int(i) for i in ids]
    n = self.vocab_size
    for i in ids:
      if not 0 <= i < n:
        raise ValueError(f"token id {i} outside the vocabulary [0, {n})")
    return self._tok.decode(ids, skip_special_tokens=skip_special)


def _byte_alphabet() -> dict:
  """{character: byte} of the byte-level BPE alphabet: the printable bytes stand for
  themselves, the other 68 for the characters from U+0100 on, in byte order."""
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) +
          list(range(0xAE, 0x100)))
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


_BYTE_OF = _byte_alphabet()


def _check_efforts(efforts) -> tuple:
  efforts = tuple(efforts)
  if not efforts or len(set(efforts)) != len(efforts) or not all(
      isinstance(e, str) and e.isidentifier() for e in efforts):
    raise ValueError(f"efforts must be distinct identifier-like names, got {efforts!r}")
  clash = [e for e in efforts if f"<{e}>" in _HEAD + _TOOL]
  if clash:
    raise ValueError(f"effort name(s) {clash} clash with the tokenizer's own special tokens")
  return efforts


def load_tokenizer(spec: str = "char", efforts=DEFAULT_EFFORTS,
                   options: TokenizerOptions = TokenizerOptions()):
  """`"char"` -> `CharTokenizer(efforts=efforts)` (the HF `options` do not apply to it); a
  path to a `tokenizer.json` (or a folder holding one) -> `HFTokenizer(path, options,
  efforts)`. ValueError for anything else."""
  import os  # pylint: disable=g-import-not-at-top
  if spec == "char":
    return CharTokenizer(efforts=efforts)
  if isinstance(spec, str) and (os.path.isfile(spec) or
                                os.path.isfile(os.path.join(spec, "tokenizer.json"))):
    return HFTokenizer(spec, options, efforts=efforts)
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
