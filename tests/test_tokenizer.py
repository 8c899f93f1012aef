"""Tokenizers: the character tokenizer's ids are stable, both tokenizers round-trip."""
import json

import pytest

from mopd_jax import tokenizer as tok_lib
from mopd_jax.tokenizer import DEFAULT_EFFORTS as EFFORTS, SPECIALS, CharTokenizer, HFTokenizer, load_tokenizer


def _hf():
  """The `tokenizers` package; the HF tests skip without it, the character ones do not."""
  return pytest.importorskip("tokenizers")


TEXTS = [
    "12+34=?",
    "23+45=68,68+67=135\n#135",
    "memo: ann>bob,cal>dan\nboss(boss(ann))?",
    "<call>boss(ann)</call><obs>bob</obs>\n#bob",
    "a=(7-1)/(2-0)=6/2=3\nb=1-3*0=1-0=1\n#3*x+1",
    "<low><high><max> x<y and y>z <notspecial>",
]


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
  """A tiny byte-level BPE tokenizer.json, trained here (no hub downloads)."""
  hf = _hf()
  decoders, models, pre_tokenizers, trainers = hf.decoders, hf.models, hf.pre_tokenizers, \
      hf.trainers
  tok = hf.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20,
                          trainer)
  path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
  tok.save(str(path))
  return str(path)


def test_char_ids_are_stable():
  # Golden ids: changing them invalidates every trained checkpoint. Update only on purpose.
  t = CharTokenizer()
  assert [t.encode(s)[0] for s in SPECIALS] == list(range(10))
  assert (t.pad_id, t.bos_id, t.eos_id) == (0, 1, 2)
  assert [t.effort_id(e) for e in EFFORTS] == [3, 4, 5]
  assert (t.call_id, t.call_end_id, t.obs_id, t.obs_end_id) == (6, 7, 8, 9)
  assert t.encode("0aA \n+~") == [10, 20, 46, 72, 73, 74, 101]
  assert t.vocab_size == 102


@pytest.mark.parametrize("text", TEXTS)
def test_char_round_trip(text):
  t = CharTokenizer()
  assert t.decode(t.encode(text)) == text


def test_char_specials_are_single_tokens_and_skippable():
  t = CharTokenizer()
  ids = t.encode("<call>boss(ann)</call><obs>bob</obs>")
  assert ids[0] == t.call_id and t.obs_id in ids and t.obs_end_id == ids[-1]
  assert len(ids) == 1 + 9 + 1 + 1 + 3 + 1
  assert t.decode(ids, skip_special=True) == "boss(ann)bob"


def test_char_bad_input():
  t = CharTokenizer()
  with pytest.raises(ValueError, match="not in the tokenizer's charset"):
    t.encode("caf\u00e9")
  with pytest.raises(ValueError, match="not in the tokenizer's charset"):
    t.encode("bad \udcff surrogate")  # what surrogateescape makes of a non-UTF-8 byte
  with pytest.raises(ValueError, match="outside the vocabulary"):
    t.decode([t.vocab_size])
  with pytest.raises(ValueError, match="unknown effort"):
    t.effort_id("medium")


def test_hf_round_trip_and_specials(hf_path):
  t = HFTokenizer(hf_path)
  base_vocab = _hf().Tokenizer.from_file(hf_path).get_vocab_size(with_added_tokens=True)
  ids = {s: t.encode(s) for s in SPECIALS}
  assert all(len(v) == 1 for v in ids.values()), ids
  assert len({v[0] for v in ids.values()}) == len(SPECIALS)
  assert min(v[0] for v in ids.values()) >= base_vocab  # added after the file's own tokens
  assert t.vocab_size == base_vocab + len(SPECIALS)
  assert [t.effort_id(e) for e in EFFORTS] == [ids[f"<{e}>"][0] for e in EFFORTS]
  assert (t.call_id, t.call_end_id, t.obs_id, t.obs_end_id) == tuple(
      ids[s][0] for s in ("<call>", "</call>", "<obs>", "</obs>"))
  assert (t.pad_id, t.bos_id, t.eos_id) == tuple(ids[s][0] for s in ("<pad>", "<bos>", "<eos>"))
  for text in TEXTS + ["h\u00e9llo  w\u00f6rld\t\u65e5\u672c <high>x", " lead <call> x </call> "]:
    enc = t.encode(text)
    assert t.decode(enc) == text
  enc = t.encode("<call>boss(ann)</call><obs>bob</obs>")
  assert enc[0] == t.call_id and t.obs_id in enc and enc[-1] == t.obs_end_id
  assert t.decode(enc, skip_special=True) == "boss(ann)bob"
  with pytest.raises(ValueError, match="unknown effort"):
    t.effort_id("medium")


def test_hf_reuses_named_tokens_and_keeps_existing_ids(hf_path, tmp_path):
  t = HFTokenizer(hf_path, pad_token="<|endoftext|>", eos_token="<|endoftext|>")
  eot = _hf().Tokenizer.from_file(hf_path).token_to_id("<|endoftext|>")
  assert t.pad_id == t.eos_id == eot and t.bos_id != eot
  with pytest.raises(ValueError, match="has no token"):
    HFTokenizer(hf_path, eos_token="</s>")
  # A file that already has "<call>" keeps its id for it.
  raw = _hf().Tokenizer.from_file(hf_path)
  raw.add_special_tokens(["<call>"])
  call = raw.token_to_id("<call>")
  raw.save(str(tmp_path / "tokenizer.json"))
  t2 = load_tokenizer(str(tmp_path))  # a folder holding tokenizer.json works too
  assert isinstance(t2, HFTokenizer) and t2.call_id == call


def test_hf_bad_input(hf_path, tmp_path):
  t = HFTokenizer(hf_path)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    t.decode([t.vocab_size])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    t.decode([-1])
  with pytest.raises(ValueError, match="expects str"):
    t.encode(b"\xff\xfe")
  with pytest.raises(ValueError, match="not valid UTF-8"):
    t.encode("bad \udcff surrogate")
  bad = tmp_path / "broken.json"
  bad.write_text(json.dumps({"not": "a tokenizer"}))
  with pytest.raises(ValueError, match="cannot load tokenizer"):
    HFTokenizer(str(bad))


def test_load_tokenizer(hf_path):
  assert isinstance(load_tokenizer("char"), CharTokenizer)
  assert isinstance(load_tokenizer(hf_path), HFTokenizer)
  with pytest.raises(ValueError, match="unknown tokenizer"):
    load_tokenizer("/no/such/tokenizer.json")
  # The run passes its prompt options to any tokenizer; the toy's ignores them.
  assert load_tokenizer("char", eos_token="x", chat=True).encode("ab") == \
      CharTokenizer().encode("ab")


def test_same_interface(hf_path):
  for t in (CharTokenizer(), HFTokenizer(hf_path)):
    for attr in ("pad_id", "bos_id", "eos_id", "call_id", "call_end_id", "obs_id", "obs_end_id",
                 "vocab_size"):
      assert isinstance(getattr(t, attr), int), attr
    assert callable(t.encode) and callable(t.decode) and callable(t.effort_id)
  assert tok_lib.DEFAULT_EFFORTS == ("low", "high", "max")


def test_hf_chat_template(hf_path, tmp_path):
  import json
  import os
  import shutil
  folder = tmp_path / "ckpt"
  folder.mkdir()
  src = hf_path if str(hf_path).endswith(".json") else os.path.join(hf_path, "tokenizer.json")
  shutil.copy(src, folder / "tokenizer.json")
  template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  t = HFTokenizer(str(folder))
  assert t.chat_template == template
  out = t.apply_chat_template([{"role": "user", "content": "hi"}])
  assert out == "<|user|>hi\n<|assistant|>"
  assert HFTokenizer(hf_path).chat_template is None
  with pytest.raises(ValueError, match="no chat_template"):
    HFTokenizer(hf_path).apply_chat_template([])


def test_effort_tokens_follow_the_configured_efforts():
  """The effort specials are the run's efforts, in order; ids stay inside the vocabulary."""
  two = CharTokenizer(efforts=("low", "max"))
  assert two.vocab_size == CharTokenizer().vocab_size - 1
  assert [two.effort_id(e) for e in ("low", "max")] == [3, 4]
  ids = two.encode("<call>~Zz</call>")
  assert max(ids) < two.vocab_size and two.decode(ids) == "<call>~Zz</call>"
  with pytest.raises(ValueError, match="unknown effort 'high'"):
    two.effort_id("high")
  five = CharTokenizer(efforts=("e0", "e1", "e2", "e3", "e4"))
  assert five.vocab_size == CharTokenizer().vocab_size + 2
  assert len({five.effort_id(f"e{i}") for i in range(5)}) == 5
  for bad in ((), ("low", "low"), ("a b",), ("call",)):
    with pytest.raises(ValueError, match="effort"):
      CharTokenizer(efforts=bad)


def test_hf_effort_specials_follow_the_configured_efforts(hf_path):
  base_vocab = _hf().Tokenizer.from_file(hf_path).get_vocab_size(with_added_tokens=True)
  t = HFTokenizer(hf_path, efforts=("short", "long"))
  assert t.vocab_size == base_vocab + len(tok_lib.specials(("short", "long")))
  assert len(t.encode("<short>")) == 1 and t.encode("<long>") == [t.effort_id("long")]
  with pytest.raises(ValueError, match="unknown effort 'max'"):
    t.effort_id("max")
  assert load_tokenizer(hf_path, efforts=("short",)).effort_id("short") >= base_vocab


CHAT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat_folder(hf_path, tmp_path):
  import shutil
  folder = tmp_path / "chat"
  folder.mkdir()
  shutil.copy(hf_path, folder / "tokenizer.json")
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT}))
  return str(folder)


def test_prompts_by_chat_template_with_the_effort_as_token_or_system_line(hf_path, tmp_path):
  """The student's prompt carries the effort (its token after the generation prompt, or a
  system line); effort None renders the teacher's prompt, with no effort at all; the toy
  layout without a chat template."""
  folder = _chat_folder(hf_path, tmp_path)
  t = HFTokenizer(folder, eos_token="<|endoftext|>")
  user = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
  assert t.decode(t.encode_prompt("2+2?", None)) == user
  assert t.encode_prompt("2+2?", "high") == t.encode(user) + [t.effort_id("high")]
  s = HFTokenizer(folder, eos_token="<|endoftext|>", effort_format="system",
                  system_line="Reasoning effort: {effort}")
  assert s.decode(s.encode_prompt("2+2?", "low")) == \
      "<|im_start|>system\nReasoning effort: low<|im_end|>\n" + user
  assert s.encode_prompt("2+2?", None) == s.encode(user)
  # As text the effort adds no token: one fewer special per effort than with effort tokens.
  assert s.vocab_size == t.vocab_size - len(EFFORTS)
  with pytest.raises(ValueError, match="system line"):
    s.effort_id("low")
  with pytest.raises(ValueError, match="unknown effort"):
    s.encode_prompt("2+2?", "medium")
  plain = HFTokenizer(folder, chat=False)
  assert plain.encode_prompt("hi", "max") == ([plain.bos_id] + plain.encode("hi\n") +
                                              [plain.effort_id("max")])
  assert CharTokenizer().encode_prompt("hi", None) == CharTokenizer().encode_prompt(
      "hi", "max")[:-1]


def test_tool_markers_and_eos_reuse_existing_tokens(hf_path, tmp_path):
  t = HFTokenizer(_chat_folder(hf_path, tmp_path), eos_token="<|endoftext|>",
                  effort_format="system",
                  tool_tokens=("<|endoftext|>", "x", "y", "z"))
  base_vocab = HFTokenizer(hf_path, effort_format="system").vocab_size
  assert t.eos_id == t.call_id  # an existing token kept its id
  with pytest.raises(ValueError, match="4 tokens"):
    HFTokenizer(hf_path, tool_tokens=("a", "b"))
  with pytest.raises(ValueError, match="must contain"):
    HFTokenizer(hf_path, effort_format="system", system_line="no placeholder")
  assert base_vocab > 0


def test_fingerprint_tells_tokenizers_apart(hf_path):
  """Equal for the same ids -> tokens; different when a token, a special id or the efforts
  differ (what a teacher server and its trainer compare at start)."""
  fp = tok_lib.fingerprint
  char = CharTokenizer()
  assert fp(char) == fp(CharTokenizer()) and len(fp(char)) == 16
  assert fp(char) != fp(CharTokenizer(charset=tok_lib.CHARSET[:-1] + "@"))
  assert fp(char) != fp(CharTokenizer(efforts=("low", "high", "xhigh")))
  hf = HFTokenizer(hf_path)
  assert fp(hf) == fp(HFTokenizer(hf_path)) and fp(hf) != fp(char)
  assert fp(hf) != fp(HFTokenizer(hf_path, eos_token="<|endoftext|>"))  # another EOS id
  assert len(hf.token_table()) == hf.vocab_size
