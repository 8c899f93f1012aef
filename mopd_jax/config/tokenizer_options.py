"""The options of a Hugging Face tokenizer (`tokenizer.HFTokenizer`) as one frozen value.

A leaf module (it imports nothing from mopd_jax): the run config builds the options
(`config.RunConfig.tokenizer_options`), the tokenizer reads them, and a record domain's
TFDS config carries them as JSON (`to_json` / `from_json`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

# The tool markers (call, call end, observation, observation end) a tokenizer adds when the
# run's data uses tools and names no tokens of its own.
TOOL_MARKERS = ("<call>", "</call>", "<obs>", "</obs>")


@dataclasses.dataclass(frozen=True)
class TokenizerOptions:
  """`pad_token`/`bos_token`/`eos_token`: the tokens of those roles (None = the files'
  own); `effort_format`: where the student's effort goes (choices.EFFORT_FORMATS); `chat`:
  render prompts with the files' chat template; `system_line`: the effort's line, with
  `{effort}`; `tool_tokens`: four existing tokens to use as the tool markers (None = the
  tokenizer's own or added); `tools`: the four markers the run's data writes, () = none."""
  pad_token: Optional[str] = None
  bos_token: Optional[str] = None
  eos_token: Optional[str] = None
  effort_format: str = "token"
  chat: bool = True
  system_line: str = "Reasoning effort: {effort}"
  tool_tokens: Optional[tuple] = None
  tools: tuple = TOOL_MARKERS

  def to_json(self) -> dict:
    """The options as plain JSON values (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self).items()}

  @classmethod
  def from_json(cls, d: dict) -> "TokenizerOptions":
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
