"""A Hugging Face tokenizer folder's own files: the special tokens they name, and the chat
template, rendered as Hugging Face's `apply_chat_template` renders it.

    files = TokenizerFiles("/ckpt/Llama-3.2-1B-Instruct")
    files.special("pad")          # None: Llama 3 names no padding token
    files.render([{"role": "user", "content": "2+2?"}])

Special tokens. `tokenizer_config.json` and `special_tokens_map.json` name them as strings
(or as AddedToken objects, `{"content": ...}`), `generation_config.json` by id (an id or a
list of ids, the first taken). `special(role)` reads `<role>_token` / `<role>_token_id` from
those files in that order and returns (the token, or the id of a generation config; the file
that names it), or None.

Chat template. The `chat_template` of tokenizer_config.json (a string, or a list of named
templates of which "default" is taken), else a `chat_template.jinja` file, else the
`chat_template` of a `chat_template.json` file. It renders in the environment transformers
gives it: a sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`, the loop
controls (`break`, `continue`), a `tojson` filter that keeps non-ASCII characters, the
functions `raise_exception(message)` and `strftime_now(format)`, the `{% generation %}` block
(rendered as its body), and the variables `messages`, `add_generation_prompt`, `tools`,
`documents` and every special token the files name (`bos_token`, `eos_token`, `pad_token`,
...). A template that does not compile or raises while rendering is a ValueError of one line
naming the file.

The probes (`user_turn_error`, `takes_system`, `after_reply`) render small conversations of
marker strings, so the tokenizer can tell what a template does with a system message and
which text ends an assistant's turn without knowing the model family.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Optional

ROLES = ("bos", "eos", "pad", "unk", "sep", "cls", "mask")
_CONFIG, _MAP, _GENERATION = ("tokenizer_config.json", "special_tokens_map.json",
                              "generation_config.json")
PROBE_USER, PROBE_SYSTEM, PROBE_REPLY = "Q7x_user_probe", "Q7x_system_probe", "Q7x_reply_probe"


def _read_json(path: str) -> dict:
  """The JSON object of `path`; {} when there is no such file."""
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      obj = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path}: cannot read ({e})") from None
  if not isinstance(obj, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
  return obj


def _token_text(value) -> Optional[str]:
  """A special token as its text: a string, or the `content` of an AddedToken object."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


class TokenizerFiles:
  """The files beside a tokenizer.json (`folder`); every file is optional."""

  def __init__(self, folder: str):
    self.folder = folder
    self.config_path = os.path.join(folder, _CONFIG)
    self._config = _read_json(self.config_path)
    self._map = _read_json(os.path.join(folder, _MAP))
    self._generation = _read_json(os.path.join(folder, _GENERATION))
    self.chat_template, self.template_path = self._find_template()
    self._compiled = None

  # --- special tokens ------------------------------------------------------------------------
  def special(self, role: str):
    """(token text or generation-config id, file path) of `<role>_token`, or None."""
    for name, obj in ((_CONFIG, self._config), (_MAP, self._map)):
      text = _token_text(obj.get(f"{role}_token"))
      if text is not None:
        return text, os.path.join(self.folder, name)
    value = self._generation.get(f"{role}_token_id")
    if isinstance(value, list):
      value = value[0] if value else None
    if isinstance(value, int) and not isinstance(value, bool):
      return value, os.path.join(self.folder, _GENERATION)
    return None

  def template_variables(self) -> dict:
    """The special tokens a template sees (`bos_token`, ...): the ones the files name."""
    out = {}
    for role in ROLES:
      for obj in (self._map, self._config):  # tokenizer_config.json wins
        text = _token_text(obj.get(f"{role}_token"))
        if text is not None:
          out[f"{role}_token"] = text
    return out

  # --- chat template -------------------------------------------------------------------------
  def _find_template(self) -> tuple:
    template = self._config.get("chat_template")
    if isinstance(template, list):  # several named templates: "default" is the chat one
      template = {t.get("name"): t.get("template") for t in template
                  if isinstance(t, dict)}.get("default")
    if isinstance(template, str) and template:
      return template, self.config_path
    jinja_path = os.path.join(self.folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        return f.read(), jinja_path
    json_path = os.path.join(self.folder, "chat_template.json")
    template = _read_json(json_path).get("chat_template")
    if isinstance(template, str) and template:
      return template, json_path
    return None, None

  def render(self, messages, add_generation_prompt: bool = True, **variables) -> str:
    """`messages` ([{"role", "content"}]) rendered by the chat template; ValueError of one
    line naming the template's file when it cannot."""
    import jinja2  # pylint: disable=g-import-not-at-top
    if not self.chat_template:
      raise ValueError(f"{self.config_path}: no chat_template")
    try:
      if self._compiled is None:  # compiled once: every prompt of a run renders with it
        self._compiled = _environment().from_string(self.chat_template)
      return self._compiled.render(**{
          "tools": None, "documents": None, **self.template_variables(), **variables,
          "messages": messages, "add_generation_prompt": add_generation_prompt})
    except jinja2.TemplateError as e:
      kind = "syntax error" if isinstance(e, jinja2.TemplateSyntaxError) else "error"
      raise ValueError(f"{self.template_path}: chat template {kind}: "
                       f"{' '.join(str(e).split())}") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
      raise ValueError(f"{self.template_path}: chat template error: {type(e).__name__}: "
                       f"{' '.join(str(e).split())}") from None

  # --- probes --------------------------------------------------------------------------------
  def user_turn_error(self) -> Optional[str]:
    """Why the template cannot render a user's turn with the generation prompt, or None."""
    try:
      out = self.render([{"role": "user", "content": PROBE_USER}])
    except ValueError as e:
      return str(e)
    if PROBE_USER not in out:
      return (f"{self.template_path}: the chat template cannot render a user turn (the "
              "user's text is not in what it renders)")
    return None

  def takes_system(self) -> bool:
    """Whether a system message before the user's turn renders, its text kept."""
    try:
      out = self.render([{"role": "system", "content": PROBE_SYSTEM},
                         {"role": "user", "content": PROBE_USER}])
    except ValueError:
      return False
    return PROBE_SYSTEM in out and PROBE_USER in out

  def after_reply(self) -> Optional[str]:
    """The text the template writes after an assistant's reply (what ends a turn), or None
    when it cannot render one."""
    try:
      out = self.render([{"role": "user", "content": PROBE_USER},
                         {"role": "assistant", "content": PROBE_REPLY}],
                        add_generation_prompt=False)
    except ValueError:
      return None
    k = out.rfind(PROBE_REPLY)
    return None if k < 0 else out[k + len(PROBE_REPLY):]


def _environment():
  """The Jinja environment of transformers' chat templates (module docstring)."""
  import jinja2  # pylint: disable=g-import-not-at-top
  import jinja2.ext  # pylint: disable=g-import-not-at-top
  import jinja2.sandbox  # pylint: disable=g-import-not-at-top

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's tokens for a
    training mask in transformers; here it renders its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.Scope(body, lineno=lineno)

  def raise_exception(message):
    raise jinja2.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env
