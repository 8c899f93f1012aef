"""Tokenizers: the character tokenizer's ids are stable, both tokenizers round-trip."""
import json
import os

import pytest

from mopd_jax.io import tokenizer as tok_lib
from mopd_jax.io.tokenizer import (CharTokenizer, DEFAULT_EFFORTS as EFFORTS, HFTokenizer,
                                   load_tokenizer, SPECIALS)
from mopd_jax.config.tokenizer_options import TokenizerOptions


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
  t = HFTokenizer(hf_path, TokenizerOptions(pad_token="<|endoftext|>", eos_token="<|endoftext|>"))
  eot = _hf().Tokenizer.from_file(hf_path).token_to_id("<|endoftext|>")
  assert t.pad_id == t.eos_id == eot and t.bos_id != eot
  with pytest.raises(ValueError, match="has no token"):
    HFTokenizer(hf_path, TokenizerOptions(eos_token="</s>"))
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
  char = load_tokenizer("char", options=TokenizerOptions(eos_token="x", chat=True))
  assert char.encode("ab") == \
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
  # An assistant's turn ends with "\n", no special token: the end of a response is unknown.
  with pytest.raises(ValueError, match="no end-of-turn token"):
    HFTokenizer(str(folder))
  t = HFTokenizer(str(folder), TokenizerOptions(eos_token="<|endoftext|>"))
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
  t = HFTokenizer(folder, TokenizerOptions(eos_token="<|endoftext|>"))
  user = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
  assert t.decode(t.encode_prompt("2+2?", None)) == user
  assert t.encode_prompt("2+2?", "high") == t.encode(user) + [t.effort_id("high")]
  s = HFTokenizer(folder, TokenizerOptions(eos_token="<|endoftext|>", effort_format="system",
                                           system_line="Reasoning effort: {effort}"))
  assert s.decode(s.encode_prompt("2+2?", "low")) == \
      "<|im_start|>system\nReasoning effort: low<|im_end|>\n" + user
  assert s.encode_prompt("2+2?", None) == s.encode(user)
  # As text the effort adds no token: one fewer special per effort than with effort tokens.
  assert s.vocab_size == t.vocab_size - len(EFFORTS)
  with pytest.raises(ValueError, match="text line"):
    s.effort_id("low")
  with pytest.raises(ValueError, match="unknown effort"):
    s.encode_prompt("2+2?", "medium")
  plain = HFTokenizer(folder, TokenizerOptions(chat=False))
  assert plain.encode_prompt("hi", "max") == ([plain.bos_id, plain.effort_id("max")] +
                                              plain.encode("hi\n"))
  # The toy layout puts the effort right after <bos>: without it the text keeps its offsets
  # from the reply.
  char = CharTokenizer()
  with_effort, without = char.encode_prompt("hi", "max"), char.encode_prompt("hi", None)
  assert with_effort == [char.bos_id, char.effort_id("max")] + char.encode("hi\n")
  assert without == with_effort[:1] + with_effort[2:]


def test_tool_markers_and_eos_reuse_existing_tokens(hf_path, tmp_path):
  t = HFTokenizer(_chat_folder(hf_path, tmp_path), TokenizerOptions(
      eos_token="<|endoftext|>", effort_format="system",
      tool_tokens=("<|endoftext|>", "x", "y", "z")))
  base_vocab = HFTokenizer(hf_path, TokenizerOptions(effort_format="system")).vocab_size
  assert t.eos_id == t.call_id  # an existing token kept its id
  with pytest.raises(ValueError, match="4 tokens"):
    HFTokenizer(hf_path, TokenizerOptions(tool_tokens=("a", "b")))
  with pytest.raises(ValueError, match="must contain"):
    HFTokenizer(hf_path, TokenizerOptions(effort_format="system", system_line="no placeholder"))
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
  # another EOS id
  assert fp(hf) != fp(HFTokenizer(hf_path, TokenizerOptions(eos_token="<|endoftext|>")))
  assert len(hf.token_table()) == hf.vocab_size


# --- the tokenizers of four model families (tests/chat_families.py) ---------------------------
import chat_families  # noqa: E402  (a helper module of the tests)
from mopd_jax.io import tokenizer_files  # noqa: E402
from mopd_jax.tasks import tools as tools_lib  # noqa: E402


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  _hf()
  root = tmp_path_factory.mktemp("families")
  return {f: chat_families.make_family(f, str(root / f)) for f in chat_families.FAMILIES}


@pytest.mark.parametrize("family", chat_families.FAMILIES)
def test_families_prompts_and_specials_from_their_files(families, family):
  """With nothing named by the config: the end of a response, padding and BOS come from the
  family's files; the student's effort is a system line where the template has a system
  role and starts the user's turn where it raises on one; the teacher's prompt has none."""
  t = HFTokenizer(families[family], TokenizerOptions(effort_format="auto", tools=()),
                  efforts=("low", "high"))
  student, teacher = chat_families.EXPECTED[family]
  assert t.decode(t.encode_prompt("2+2?", "high")) == student
  assert t.encode_prompt("2+2?", "high") == t.encode(student)
  assert t.decode(t.encode_prompt("2+2?", None)) == teacher
  assert t.encode_prompt("2+2?", None) == t.encode(teacher)
  eos, pad, bos, where = chat_families.READ[family]
  assert (t.decode([t.eos_id]), t.decode([t.pad_id]), t.decode([t.bos_id])) == (eos, pad, bos)
  assert t.effort_format == where
  raw = _hf().Tokenizer.from_file(os.path.join(families[family], "tokenizer.json"))
  # Only a padding token the files do not name is added; no tool marker is asked for.
  assert t.vocab_size == raw.get_vocab_size(with_added_tokens=True) + (pad == "<pad>" and
                                                                       raw.token_to_id(pad) is None)
  assert (t.call_id, t.call_end_id, t.obs_id, t.obs_end_id) == (None,) * 4
  # The config's names still win.
  named = HFTokenizer(families[family], TokenizerOptions(eos_token=bos, pad_token=bos, tools=()))
  assert named.eos_id == named.pad_id == t.bos_id


@pytest.mark.parametrize("family", chat_families.FAMILIES)
def test_families_render_as_transformers_renders(families, family):
  """The same text as transformers' apply_chat_template for the same files and messages."""
  transformers = pytest.importorskip("transformers")
  ref = transformers.PreTrainedTokenizerFast.from_pretrained(families[family])
  ours = HFTokenizer(families[family], TokenizerOptions(tools=()))
  user = [{"role": "user", "content": "2+2?"}]
  chats = [(user, True), (user + [{"role": "assistant", "content": " 4 "}], False)]
  if family in ("qwen3", "llama3"):
    chats.append(([{"role": "system", "content": "be brief"}] + user, True))
  for messages, gen in chats:
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
        ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
  schema = {"type": "function", "function": {"name": "lookup", "description": "été",
                                             "parameters": {"type": "object"}}}
  assert ours.apply_chat_template(user, tools=[schema], enable_thinking=False) == \
      ref.apply_chat_template(user, tools=[schema], tokenize=False, add_generation_prompt=True,
                              enable_thinking=False)


def test_effort_format_can_be_forced(families):
  gemma, llama = families["gemma"], families["llama3"]
  with pytest.raises(ValueError, match="gemma/tokenizer_config.json: the chat template does "
                     "not render a system message"):
    HFTokenizer(gemma, TokenizerOptions(effort_format="system", tools=()))
  user = HFTokenizer(llama, TokenizerOptions(effort_format="user", tools=()))
  assert user.decode(user.encode_prompt("2+2?", "max")) == (
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nReasoning effort: max\n\n"
      "2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
  token = HFTokenizer(gemma, TokenizerOptions(effort_format="token", tools=()))
  assert token.encode_prompt("2+2?", "max") == token.encode(
      chat_families.EXPECTED["gemma"][1]) + [token.effort_id("max")]


def test_tool_markers_taken_added_or_not_asked_for(families, caplog):
  import logging
  caplog.set_level(logging.INFO)
  qwen = HFTokenizer(families["qwen3"],
                     TokenizerOptions(effort_format="auto", tools=tools_lib.MARKERS))
  raw = _hf().Tokenizer.from_file(os.path.join(families["qwen3"], "tokenizer.json"))
  assert (qwen.call_id, qwen.call_end_id, qwen.obs_id, qwen.obs_end_id) == tuple(
      raw.token_to_id(m) for m in tools_lib.MARKERS)
  assert qwen.vocab_size == raw.get_vocab_size(with_added_tokens=True)
  assert "tool markers <tool_call> </tool_call> <tool_response> </tool_response> taken from " \
      "the tokenizer" in caplog.text
  caplog.clear()
  llama = HFTokenizer(families["llama3"],
                      TokenizerOptions(effort_format="auto", tools=tools_lib.MARKERS))
  none = HFTokenizer(families["llama3"], TokenizerOptions(effort_format="auto", tools=()))
  assert llama.vocab_size == none.vocab_size + 4
  assert llama.decode([llama.call_id, llama.obs_end_id]) == "<tool_call></tool_response>"
  assert [r.getMessage() for r in caplog.records if "tool markers" in r.getMessage()] == [
      f"{families['llama3']}/tokenizer.json: tool markers <tool_call> </tool_call> "
      "<tool_response> </tool_response> added to the vocabulary (<tool_call>, </tool_call>, "
      "<tool_response>, </tool_response>)"]
  # Four existing tokens named by the config replace the data's markers.
  named = HFTokenizer(families["llama3"], TokenizerOptions(
      effort_format="auto", tools=tools_lib.MARKERS,
      tool_tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|end_of_text|>")))
  assert named.vocab_size == none.vocab_size and named.call_end_id == none.encode(
      "<|end_header_id|>")[0]
  # The toy tokenizer always has its markers (its ids are fixed).
  assert load_tokenizer("char", options=TokenizerOptions(tools=())).call_id == 6


def _folder_with(tmp_path, source, **files):
  import shutil
  folder = tmp_path / "tok"
  folder.mkdir()
  shutil.copy(os.path.join(source, "tokenizer.json"), folder / "tokenizer.json")
  for name, obj in files.items():
    (folder / f"{name}.json").write_text(json.dumps(obj))
  return str(folder)


@pytest.mark.parametrize("files, match", [
    ({"tokenizer_config": {"chat_template": "{{ raise_exception('no chat here') }}"}},
     "tokenizer_config.json: chat template error: no chat here"),
    ({"tokenizer_config": {"chat_template": "{% for m in messages %}x{% endfor %}"}},
     "tokenizer_config.json: the chat template cannot render a user turn"),
    ({"tokenizer_config": {"chat_template": "{% for m in messages %}{{ m.content }"}},
     "tokenizer_config.json: chat template syntax error"),
    ({"tokenizer_config": {"chat_template": "{% for m in messages %}[{{ m.content }}]\n"
                                            "{% endfor %}"}},
     "tokenizer_config.json: the chat template ends an assistant turn with '\\]\\\\n', not "
     "with a special token .* no end-of-turn token"),
    ({"tokenizer_config": {"chat_template": chat_families.GEMMA, "pad_token": "<|pad|>"}},
     "tokenizer_config.json: names '<|pad|>' as the pad token, which .* does not have"),
    ({"special_tokens_map": {"bos_token": "<|bos|>"}, "tokenizer_config": {}},
     "special_tokens_map.json: names '<|bos|>' as the bos token"),
])
def test_bad_tokenizer_files_are_one_line_naming_the_file(families, tmp_path, files, match):
  folder = _folder_with(tmp_path, families["gemma"], **files)
  with pytest.raises(ValueError, match=match) as e:
    HFTokenizer(folder, TokenizerOptions(tools=()))
  assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_template_environment_has_transformers_helpers(tmp_path):
  """raise_exception, strftime_now, tojson keeping non-ASCII text, loop controls, the
  generation block, bos/eos variables and `tools`; templates from a chat_template.jinja."""
  import datetime
  folder = tmp_path / "t"
  folder.mkdir()
  (folder / "chat_template.jinja").write_text(
      "{{ bos_token }}{{ strftime_now('%Y') }}|{{ tools | tojson }}|"
      "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
      "{% generation %}{{ m.content }}{% endgeneration %}{{ eos_token }}{% endfor %}")
  (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>",
                                                               "eos_token": "</s>"}))
  files = tokenizer_files.TokenizerFiles(str(folder))
  out = files.render([{"role": "user", "content": "a"}, {"role": "skip", "content": "b"}],
                     tools=[{"name": "\u00e9t\u00e9"}])
  assert out == f"<s>{datetime.datetime.now().year}|[{{\"name\": \"\u00e9t\u00e9\"}}]|a</s>"
  assert files.template_path == str(folder / "chat_template.jinja")
