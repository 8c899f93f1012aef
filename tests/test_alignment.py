"""Rewards across tokenizers (mopd_jax/teachers/alignment.py): spans of common byte
boundaries, span log-ratios whose sum is the sequence log-ratio, one clip per span, the two
assignment rules, UTF-8 cut inside a character, and the reduction to eq. 15."""
import numpy as np
import pytest

from mopd_jax.teachers import alignment as al


def _merge(pieces, rng, p=0.5):
  """A coarser tokenization of the same bytes: neighbours joined at random."""
  out = [pieces[0]]
  for x in pieces[1:]:
    if rng.random() < p:
      out[-1] = out[-1] + x
    else:
      out.append(x)
  return out


def test_the_same_tokenization_is_eq_15_exactly():
  import jax.numpy as jnp
  from mopd_jax.training import losses
  rng = np.random.default_rng(0)
  pieces = list("12+3=15 #7")
  lp_s = (-rng.random(len(pieces)) * 8).astype(np.float32)
  lp_t = (-rng.random(len(pieces)) * 8).astype(np.float32)
  a = al.align(pieces, pieces)
  assert a.num_spans == len(pieces) and a.multi_token_share() == 0.0
  want = np.asarray(losses.mopd_reward(jnp.asarray(lp_s[None]), jnp.asarray(lp_t[None]),
                                       jnp.ones((1, len(pieces)), bool), r_max=5.0))[0]
  for rule in al.ASSIGN_RULES:
    got = al.token_rewards(a, lp_s, lp_t, r_max=5.0, assign=rule)
    assert got.dtype == np.float32 and np.array_equal(got, want)  # bitwise


@pytest.mark.parametrize("seed", range(5))
def test_spans_cover_the_same_bytes_and_sum_to_the_sequence_log_ratio(seed):
  rng = np.random.default_rng(seed)
  text = "".join(rng.choice(list("ab12 +=#\n"), size=40))
  student = list(text)
  teacher = _merge(student, rng)
  a = al.align(student, teacher)
  for j in range(a.num_spans):
    s = "".join(student[a.student[j]:a.student[j + 1]])
    t = "".join(teacher[a.teacher[j]:a.teacher[j + 1]])
    assert s == t and s  # the same bytes, never empty
  assert a.multi_token_share() > 0
  lp_s = -rng.random(len(student))
  lp_t = -rng.random(len(teacher)) * 3
  d = al.span_log_ratios(a, lp_s, lp_t)
  assert d.sum() == pytest.approx(lp_t.sum() - lp_s.sum(), abs=1e-4)
  for rule in al.ASSIGN_RULES:  # unclipped (r_max large): the row sums to the same
    r = al.token_rewards(a, lp_s, lp_t, r_max=1e6, assign=rule)
    assert r.shape == (len(student),)
    assert r.sum() == pytest.approx(lp_t.sum() - lp_s.sum(), abs=1e-4)


def test_one_clip_per_span_and_the_two_rules():
  student, teacher = ["a", "b", "c", "d"], ["ab", "c", "d"]
  a = al.align(student, teacher)
  np.testing.assert_array_equal(a.student, [0, 2, 3, 4])
  np.testing.assert_array_equal(a.teacher, [0, 1, 2, 3])
  lp_s = np.asarray([-1.0, -1.0, -2.0, -0.5], np.float32)
  lp_t = np.asarray([-9.0, -1.0, -0.25], np.float32)  # span "ab": -9 - (-2) = -7
  spread = al.token_rewards(a, lp_s, lp_t, r_max=5.0)
  np.testing.assert_allclose(spread, [-2.5, -2.5, 1.0, 0.25])  # -7 clipped to -5, halved
  last = al.token_rewards(a, lp_s, lp_t, r_max=5.0, assign="last")
  np.testing.assert_allclose(last, [0.0, -5.0, 1.0, 0.25])
  with pytest.raises(ValueError, match="assign must be one of"):
    al.token_rewards(a, lp_s, lp_t, r_max=5.0, assign="first")


def test_spaces_merged_differently():
  a = al.align(["x", " ", "=", " ", "1"], ["x", " =", " 1"])
  np.testing.assert_array_equal(a.student, [0, 1, 3, 5])
  np.testing.assert_array_equal(a.teacher, [0, 1, 2, 3])


def test_utf8_cut_inside_a_character_by_a_byte_level_tokenizer():
  text = "é=日本"
  student = list(text)  # one token per character
  raw = text.encode("utf-8")  # é: 2 bytes, 日 and 本: 3 each
  teacher = [raw[:1], raw[1:3], raw[3:7], raw[7:]]  # cuts inside é, 日 and 本
  a = al.align(student, teacher)
  spans = [(b"".join(s.encode() for s in student[a.student[j]:a.student[j + 1]]),
            b"".join(teacher[a.teacher[j]:a.teacher[j + 1]])) for j in range(a.num_spans)]
  assert all(s == t for s, t in spans)
  # Byte offsets 1, 3, 7, 9 against the characters' 2, 3, 6, 9: "=" ends both at 3.
  assert [s.decode() for s, _ in spans] == ["é=", "日本"]
  b = al.align(student, [raw[:2], raw[2:3], raw[3:6], raw[6:]])  # whole characters
  assert b.num_spans == 4


def test_unencodable_text_has_no_alignment():
  with pytest.raises(al.Unalignable, match="token 1 has no bytes"):
    al.align(list("ab"), ["a", None])
  with pytest.raises(al.Unalignable, match="cover 3 and 2 bytes"):
    al.align(list("abc"), ["ab"])


def test_zero_byte_tokens_join_a_span():
  a = al.align(["a", "", "b"], ["a", "b", ""])
  np.testing.assert_array_equal(a.student, [0, 2, 3])
  np.testing.assert_array_equal(a.teacher, [0, 1, 3])
  r = al.token_rewards(a, [-1.0, -0.5, -1.0], [-2.0, -1.0, -0.25], r_max=5.0)
  np.testing.assert_allclose(r, [-0.25, -0.25, -0.25])


def test_an_empty_response_gets_no_reward():
  a = al.align([], [])
  assert a.num_spans == 0
  assert al.token_rewards(a, [], [], r_max=5.0).shape == (0,)


def test_token_bytes_of_the_character_and_a_byte_level_bpe_tokenizer(tmp_path):
  """The tokenizers give each token's bytes: the character tokenizer's characters (b"" for
  its specials, so the end of the response joins the last span), and a byte-level BPE
  fitted on toy text (GPT-2's byte alphabet, as Llama 3 and Qwen use) exactly, a UTF-8
  character cut between tokens included; aligned, spans where the teacher merged
  characters."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from mopd_jax.io.tokenizer import CharTokenizer, load_tokenizer
  char = CharTokenizer()
  text = "12+3=15\n#7"
  ids = char.encode(text) + [char.eos_id]
  assert char.token_bytes(ids) == [c.encode() for c in text] + [b""]
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  corpus = ["3+4+5=12 #2", "12+3=15\n#7", "boss(ann)=bob #bob", "x=é日本 #0"] * 50
  bpe.train_from_iterator(corpus, trainers.BpeTrainer(
      vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  bpe.save(str(tmp_path / "tokenizer.json"))
  teacher = load_tokenizer(str(tmp_path / "tokenizer.json"))
  for t in ("12+3=15\n#7", "x=é日本 #0", "boss(ann)=bob #bob"):
    t_ids = teacher.encode(t) + [teacher.eos_id]
    pieces = teacher.token_bytes(t_ids)
    assert b"".join(pieces) == t.encode() and pieces[-1] == b""
    s_ids = char.encode(t) if all(c in char._chars for c in t) else None
    student = char.token_bytes(s_ids + [char.eos_id]) if s_ids else list(t)
    a = al.align(student, pieces)
    assert a.student[-1] == len(student) and a.teacher[-1] == len(pieces)
  a = al.align(char.token_bytes(char.encode("12+3=15\n#7")),
               teacher.token_bytes(teacher.encode("12+3=15\n#7")))
  np.testing.assert_array_equal(a.student, [0, 2, 3, 4, 5, 7, 8, 9, 10])  # "12" and "15"
  assert a.multi_token_share() == 2 / 8  # two of the teacher's 8 tokens span 2 characters


def test_retokenize_maps_the_response_and_its_end_to_the_teachers_tokens(tmp_path):
  """The student's response ids become the teacher's (its own tokenizer on the response
  text, its end of response for the student's); the alignment's spans cover both, the two
  end tokens a span of their own. A teacher without a character of the response:
  Unalignable."""
  from mopd_jax.io.tokenizer import CharTokenizer
  student = CharTokenizer()
  teacher = CharTokenizer(charset="0123456789+=#\n ")  # digits and a few symbols only
  ids = student.encode("12+3=15\n#7") + [student.eos_id]
  t_ids, a = al.retokenize(student, teacher, ids)
  assert teacher.decode(t_ids, skip_special=True) == "12+3=15\n#7"
  assert t_ids[-1] == teacher.eos_id and a.num_spans == 11
  assert (a.student[-3:] == [9, 10, 11]).all() and (a.teacher[-3:] == [9, 10, 11]).all()
  lp = np.linspace(-1, -0.1, len(ids)).astype(np.float32)
  np.testing.assert_array_equal(al.token_rewards(a, lp, lp, r_max=5.0), np.zeros(len(ids)))
  with pytest.raises(al.Unalignable, match="cannot encode the response"):
    al.retokenize(student, teacher, student.encode("boss(x)"))


def _bpe(tmp_path, texts):
  """A byte-level BPE fitted on `texts` with the toy's specials, as an HFTokenizer with the
  tool markers (no chat template: the toy's prompt layout)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io.tokenizer import HFTokenizer, SPECIALS
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=300, special_tokens=list(SPECIALS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return HFTokenizer(str(path), TokenizerOptions(tools=("<call>", "</call>", "<obs>", "</obs>")))


def test_retokenize_response_keeps_tool_turns_and_never_crosses_a_run(tmp_path):
  """A multi-turn response (a generated call, an observation the environment inserted, the
  answer) moves to a BPE teacher's tokens: the markers map by role, the observation stays
  an observation (gen_mask 0), no span mixes generated and observation tokens, and moving
  it back gives the student's ids."""
  from mopd_jax.io.tokenizer import CharTokenizer
  student = CharTokenizer()
  teacher = _bpe(tmp_path, ["boss(boss(ann))", "ann>bob>cal", "#dan", "error: unknown name"] * 50)
  call = [student.call_id] + student.encode("boss(ann)") + [student.call_end_id]
  obs = [student.obs_id] + student.encode("bob") + [student.obs_end_id]
  tail = student.encode("\n#bob") + [student.eos_id]
  ids = call + obs + tail
  gen = [1] * len(call) + [0] * len(obs) + [1] * len(tail)
  t_ids, t_gen, a = al.retokenize_response(student, teacher, ids, gen_mask=gen)
  assert len(t_ids) < len(ids)  # BPE merges
  assert t_ids[0] == teacher.call_id and teacher.obs_id in t_ids and t_ids[-1] == teacher.eos_id
  assert teacher.decode(t_ids, skip_special=True) == student.decode(ids, skip_special=True)
  g_s, g_t = np.asarray(gen), np.asarray(t_gen)
  for j in range(a.num_spans):
    s_run, t_run = g_s[a.student[j]:a.student[j + 1]], g_t[a.teacher[j]:a.teacher[j + 1]]
    assert len(set(s_run)) == 1 and set(s_run) == set(t_run)
  back, back_gen, _ = al.retokenize_response(teacher, student, t_ids, gen_mask=t_gen)
  assert back == ids and back_gen == gen
  lp_s = -np.linspace(0.1, 2.0, len(ids))
  lp_t = -np.linspace(0.3, 1.0, len(t_ids))
  d = al.span_log_ratios(a, lp_s, lp_t)
  np.testing.assert_allclose(d.sum(), lp_t.sum() - lp_s.sum(), rtol=1e-5)
  with pytest.raises(al.Unalignable, match="no token for 'call'"):
    al.retokenize_response(student, _NoTools(), call, gen_mask=[1] * len(call))


class _NoTools:
  """A tokenizer without tool markers (the roles it lacks are missing attributes)."""
  eos_id, pad_id, bos_id, efforts = 2, 0, 1, ()

  def encode(self, text):
    return [ord(c) for c in text]

  def token_bytes(self, ids):
    return [chr(i).encode() for i in ids]


def test_a_response_to_its_own_tokenizer_stays_as_sampled(tmp_path):
  """A family of the student's tokenizer in a run of several: the response the student drew
  in a tokenization its encoder would not write (single bytes where BPE merges) reaches the
  teacher as drawn, a span per token, so its rewards are eq. 15's."""
  tok = _bpe(tmp_path, ["ann>bob>cal", "boss(boss(ann))"] * 50)
  text = "ann>bob"
  merged = list(tok.encode(text))
  drawn = [tok.encode(ch)[0] for ch in text] + [tok.eos_id]
  assert len(drawn) - 1 > len(merged)  # not the encoder's tokenization
  ids, gen, a = al.retokenize_response(tok, tok, drawn, gen_mask=[1] * len(drawn))
  assert ids == drawn and gen == [1] * len(drawn) and a.num_spans == len(drawn)
  lp_s = -np.linspace(0.1, 2.0, len(drawn)).astype(np.float32)
  lp_t = -np.linspace(0.3, 1.0, len(drawn)).astype(np.float32)
  out = al.teacher_logprobs_on_student(a, lp_s, lp_t, gen_mask=[1] * len(drawn), r_max=5.0,
                                       assign="spread")
  np.testing.assert_array_equal(out, lp_t)
