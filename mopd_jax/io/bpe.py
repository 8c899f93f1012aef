"""A byte-level BPE tokenizer fitted on a corpus, written as a Hugging Face `tokenizer.json`:
the second tokenizer of the cross-tokenizer toy (its teachers write multi-character tokens
where the student writes one token per character) and of the tests. The toy's special
tokens (`tokenizer.specials`: PAD/BOS/EOS, the efforts, the tool markers) are the file's
first ids, so `HFTokenizer` finds them and adds none; every byte is in the alphabet, so any
text encodes."""
from __future__ import annotations

from typing import Iterable, Sequence

from mopd_jax.io import storage


# Each digit its own pre-token, with the comma or plus sign that follows it; the rest in
# runs of non-digits: no token holds two digits. The plus joins the digit before it because
# the toy's gen answers are digit chains "d+d+..." (docs/cross_tokenizer.md: with the plus
# a token of its own the gen/max teachers learn the task poorly).
DIGITS_APART = r"\d[,+]?|\D+"


def fit(texts: Iterable[str], path: str, *, vocab_size: int = 512,
        specials: Sequence[str] = (), digits_apart: bool = False) -> str:
  """Fits a byte-level BPE of at most `vocab_size` tokens on `texts` with `specials` first,
  saves it at `path` (a `tokenizer.json` file, or a directory to put one in) and returns the
  file. No pre-split beyond the byte-level one, or, with `digits_apart`, none of its tokens
  holds two digits (`DIGITS_APART`: a digit and the comma or plus after it may be one token), as
  tokenizers that split numbers into digits do."""
  from tokenizers import (Regex, Tokenizer, decoders, models,  # pylint: disable=g-import-not-at-top
                          pre_tokenizers, trainers)
  if vocab_size <= 256 + len(specials):
    raise ValueError(f"vocab_size={vocab_size} leaves no merges after the 256 bytes and "
                     f"{len(specials)} specials")
  tok = Tokenizer(models.BPE())
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.pre_tokenizer = byte_level if not digits_apart else pre_tokenizers.Sequence(
      [pre_tokenizers.Split(Regex(DIGITS_APART), behavior="isolated"), byte_level])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if not str(path).endswith(".json"):
    path = storage.join(path, "tokenizer.json")
  storage.write_text(path, tok.to_str())  # local or gs://, its folder made as needed
  return path


def multi_char_share(tok, texts: Iterable[str]) -> float:
  """The share of `tok`'s tokens of `texts` that stand for two or more characters."""
  total = multi = 0
  for text in texts:
    for piece in tok.token_bytes(tok.encode(text)):
      total += 1
      multi += len(piece.decode("utf-8", errors="replace")) > 1
  return multi / max(total, 1)
