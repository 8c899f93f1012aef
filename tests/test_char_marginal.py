"""Next-character targets from a teacher of another tokenizer
(mopd_jax/teachers/char_marginal.py), checked against a teacher whose character-level
distribution is known exactly: a source of strings over a small alphabet, and a teacher that
writes each string in its tokenizer's own encoding (a digit and the `+` after it one token),
with the source's probability. Read by characters, that teacher is the source; the targets
must give the source's next-character distribution at every position of any response, in
both the tokens that cross the end of the text and the partial-token branches."""
import itertools
import types

import numpy as np
import pytest

from mopd_jax.io import tokenizer
from mopd_jax.teachers import alignment, char_marginal as cm, char_served

ALPHABET = "12+\n"
LONGEST = 5  # the source's strings end by this many characters


class PlusTokenizer:
  """A teacher tokenizer: pad, bos, eos, then each character of ALPHABET; with `merges`
  "pairs" a digit joined with the `+` after it, with "three" also `12+` (whose part `12` is
  no token); its encoder always joins what it can, longest first."""

  def __init__(self, merges: str):
    self.pieces = ["<pad>", "<bos>", "<eos>"] + list(ALPHABET)
    if merges in ("pairs", "three"):
      self.pieces += ["1+", "2+"]
    if merges == "three":
      self.pieces += ["12+"]
    self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
    self.ids = {p: i for i, p in enumerate(self.pieces)}

  @property
  def vocab_size(self):
    return len(self.pieces)

  def encode(self, text):
    out, i = [], 0
    while i < len(text):
      n = next(n for n in (3, 2, 1) if text[i:i + n] in self.ids)
      out.append(self.ids[text[i:i + n]])
      i += n
    return out

  def decode(self, ids, skip_special=False):
    return "".join(self.pieces[i] for i in ids if not (skip_special and i < 3))

  def token_bytes(self, ids):
    return [b"" if i < 3 else self.pieces[i].encode() for i in ids]


def _source(seed: int) -> dict:
  """{string: probability} of a random first-order source over ALPHABET that ends each
  string with probability 0.2 per step, at LONGEST at the latest."""
  rng = np.random.default_rng(seed)
  trans = {p: rng.dirichlet(np.ones(len(ALPHABET))) for p in [""] + list(ALPHABET)}
  out = {}

  def walk(s, prob):
    if len(s) == LONGEST:
      out[s] = prob
      return
    out[s] = prob * 0.2
    for c, pc in zip(ALPHABET, trans[s[-1:]]):
      walk(s + c, prob * 0.8 * pc)
  walk("", 1.0)
  return out


def _teacher(source: dict, ttok: PlusTokenizer):
  """The teacher's next-token distribution after each of its token prefixes: every string
  written in its tokenizer's encoding, then eos, with the source's probability."""
  mass = {}
  for s, p in source.items():
    seq = tuple(ttok.encode(s)) + (ttok.eos_id,)
    for n in range(len(seq)):
      nxt = mass.setdefault(seq[:n], np.zeros(ttok.vocab_size))
      nxt[seq[n]] += p

  def dist(prefix):
    got = mass.get(tuple(prefix))
    if got is None or not got.sum():
      return np.full(ttok.vocab_size, 1.0 / ttok.vocab_size)
    return got / got.sum()
  return dist


def _char_dist(source: dict, s: str) -> dict:
  """The source's next character (or "eos") after s."""
  under = {x: p for x, p in source.items() if x.startswith(s)}
  total = sum(under.values())
  out = {c: sum(p for x, p in under.items() if x.startswith(s + c)) / total for c in ALPHABET}
  out["eos"] = under.get(s, 0.0) / total
  return out


def _batch(stok, ttok, responses, prompt_t):
  """A one-teacher `SampledBatch` stand-in of the student's responses (each ending in eos
  or cut), the teacher's rows after its prompt `prompt_t`."""
  rows, trows, spans, aligned = [], [], [], []
  prompt_s = [stok.bos_id]
  for text, ended in responses:
    ids = stok.encode(text) + ([stok.eos_id] if ended else [])
    t_ids, gen, a = alignment.retokenize_response(stok, ttok, ids, gen_mask=[1] * len(ids))
    rows.append((prompt_s + ids, [0] * len(prompt_s) + [1] * len(ids)))
    trows.append(prompt_t + t_ids)
    spans.append((len(prompt_s), len(prompt_t), len(ids)))
    aligned.append(a)
  w, wt = max(len(r[0]) for r in rows) + 1, max(len(t) for t in trows) + 1
  tokens = np.zeros((len(rows), w), np.int32)
  loss = np.zeros((len(rows), w), bool)
  ttoks = np.zeros((1, len(rows), wt), np.int32)
  tmask = np.zeros((1, len(rows), wt), bool)
  for i, ((r, m), t) in enumerate(zip(rows, trows)):
    tokens[i, :len(r)], loss[i, :len(m)] = r, m
    ttoks[0, i, :len(t)], tmask[0, i, :len(t)] = t, True
  return types.SimpleNamespace(
      arr={"tokens": tokens, "loss_mask": loss}, index=np.arange(len(rows))[None],
      tokens=ttoks, input_mask=tmask, spans=spans, alignments=aligned,
      tokenizers=(stok, ttok))


def _oracle(dist, prompt_len: int):
  """`next_logprobs` of the teacher `dist`: each row's response tokens up to `at`."""
  def next_logprobs(cfg, params, tokens, *, mask_KxnxT, at_KxnxA):
    del cfg, params, mask_KxnxT
    at = at_KxnxA
    k, n, a = at.shape
    out = np.zeros((k, n, a, len(dist([]))), np.float32)
    for i, j, x in itertools.product(range(k), range(n), range(a)):
      pos = int(at[i, j, x])
      p = dist(tokens[i, j, prompt_len:pos + 1]) if pos >= prompt_len - 1 else dist([])
      with np.errstate(divide="ignore"):
        out[i, j, x] = np.log(p)
    return out
  return next_logprobs


@pytest.mark.parametrize("merges", ["none", "pairs", "three"])
@pytest.mark.parametrize("seed", [0, 1])
def test_targets_are_the_teachers_distribution_by_characters(monkeypatch, merges, seed):
  stok = tokenizer.CharTokenizer(charset=ALPHABET)
  ttok = PlusTokenizer(merges)
  source = _source(seed)
  prompt_t = [ttok.bos_id, ttok.ids["1"], ttok.ids["\n"]]
  monkeypatch.setattr(cm, "next_logprobs", _oracle(_teacher(source, ttok), len(prompt_t)))
  responses = [("1+2\n", True), ("12+1+", False), ("2+2+2", True), ("+\n1", True),
               ("2", True), ("", True), ("1+1+", True), ("212+", True), ("12+12", True)]
  batch = _batch(stok, ttok, responses, prompt_t)
  bank = types.SimpleNamespace(model_cfg=None, params=None)
  table = cm.CharTable(stok, ttok)
  lp, ok, counts = cm.targets(bank, batch, table, student_tok=stok, teacher_tok=ttok)
  assert counts["char_positions"] == sum(len(t) + e for t, e in responses)
  # A text inside a teacher token ("1" of "1+", "12" of "12+") is a branch.
  assert (counts["char_branches"] > 0) == (merges != "none")
  for r, (text, ended) in enumerate(responses):
    ps = batch.spans[r][0]
    for i in range(len(text) + ended):
      assert ok[r, ps + i]
      want = _char_dist(source, text[:i])
      got = np.exp(lp[r, ps + i].astype(np.float64))
      for c in ALPHABET:
        assert got[stok.encode(c)[0]] == pytest.approx(want[c], abs=1e-6), (text, i, c)
      assert got[stok.eos_id] == pytest.approx(want["eos"], abs=1e-6), (text, i)
      assert got.sum() == pytest.approx(1.0, abs=1e-5)  # nothing on other specials


class _Servers:
  """A `teacher_client.EndpointScorer` built with `top_k`, answering from the teacher
  `dist` as a server's prompt log-probs do: at position t >= 1 of a row the log-prob of its
  token t and the top k of the distribution that predicts it."""

  def __init__(self, dist, prompt_len: int, *, k: int, names=("gen/low",)):
    self.dist, self.prompt_len, self.top_k, self.names = dist, prompt_len, k, names

  def submit(self, tokens, mask):
    shape = tokens.shape
    lp = np.zeros(shape, np.float32)
    tk_lp, tk_ids = np.zeros(shape + (self.top_k,), np.float32), np.zeros(
        shape + (self.top_k,), np.int32)
    for k, j in zip(*np.nonzero(mask.sum(-1))):
      for t in range(1, int(mask[k, j].sum())):
        p = self.dist(tokens[k, j, self.prompt_len:t] if t > self.prompt_len - 1 else [])
        with np.errstate(divide="ignore"):
          logp = np.log(p).astype(np.float32)
        lp[k, j, t] = logp[tokens[k, j, t]]
        best = np.argsort(-logp, kind="stable")[:self.top_k]
        tk_lp[k, j, t], tk_ids[k, j, t] = logp[best], best
    return lp, tk_lp, tk_ids

  def fetch(self, submitted):
    return submitted


@pytest.mark.parametrize("merges", ["pairs", "three"])
def test_served_teachers_read_by_their_top_k(monkeypatch, merges):
  """`Served`: with k the teacher's whole vocabulary the targets are the in-process ones,
  bitwise (the distribution after a row's last token read through its filler token); with
  a smaller k each position's targets are still a distribution, over what the top k and the
  row's own next token reach."""
  from mopd_jax.teachers import bank as bank_mod
  stok, ttok = tokenizer.CharTokenizer(charset=ALPHABET), PlusTokenizer(merges)
  source = _source(0)
  prompt_t = [ttok.bos_id, ttok.ids["1"], ttok.ids["\n"]]
  teacher = _teacher(source, ttok)
  monkeypatch.setattr(cm, "next_logprobs", _oracle(teacher, len(prompt_t)))
  batch = _batch(stok, ttok, [("1+2\n", True), ("12+1+", False), ("212+", True),
                              ("12+12", True)], prompt_t)
  table = cm.CharTable(stok, ttok)
  want, ok, n = cm.targets(types.SimpleNamespace(model_cfg=None, params=None), batch, table,
                           student_tok=stok, teacher_tok=ttok)
  assert n["char_branches"] > 0
  bank = types.SimpleNamespace(router=bank_mod.Router(("gen/low",)),
                               model_cfg=types.SimpleNamespace(vocab_size=ttok.vocab_size))
  for k in (ttok.vocab_size, 2):
    served = char_served.Served(bank, ((("gen/low",), _Servers(teacher, len(prompt_t), k=k)),))
    got, got_ok, got_n = cm.targets(served, batch, table, student_tok=stok, teacher_tok=ttok)
    assert got_n == n
    np.testing.assert_array_equal(got_ok, ok)
    if k == ttok.vocab_size:
      np.testing.assert_array_equal(got, want)
    else:
      sums = np.exp(got[ok].astype(np.float64)).sum(-1)
      np.testing.assert_allclose(sums, 1.0, atol=1e-5)
      assert np.abs(got[ok] - want[ok]).max() > 1e-3  # the tail past the top 2 is left out


class _Counted(_Servers):
  """`_Servers` counting the rows it is sent."""
  sent = 0

  def submit(self, tokens, mask):
    self.sent += int(np.asarray(mask).any(-1).sum())
    return super().submit(tokens, mask)


def test_served_targets_and_eq15_scores_share_one_request(monkeypatch):
  """`Served` as the step's scorer: `submit`/`fetch` give eq. 15's scores of the batch (the
  log-probs the servers give its rows' tokens, 0 past each row), and the targets read
  afterwards send no row of the batch again, only their branches; the targets equal those of
  a `Served` that asks for everything itself, bitwise."""
  from mopd_jax.teachers import bank as bank_mod
  stok, ttok = tokenizer.CharTokenizer(charset=ALPHABET), PlusTokenizer("three")
  prompt_t = [ttok.bos_id, ttok.ids["1"], ttok.ids["\n"]]
  teacher = _teacher(_source(1), ttok)
  monkeypatch.setattr(cm, "next_logprobs", _oracle(teacher, len(prompt_t)))
  batch = _batch(stok, ttok, [("1+2\n", True), ("12+1+", False), ("212+", True)], prompt_t)
  bank = types.SimpleNamespace(router=bank_mod.Router(("gen/low",)),
                               model_cfg=types.SimpleNamespace(vocab_size=ttok.vocab_size))
  table = cm.CharTable(stok, ttok)
  alone = _Counted(teacher, len(prompt_t), k=3)
  want = cm.targets(char_served.Served(bank, ((("gen/low",), alone),)), batch, table,
                    student_tok=stok, teacher_tok=ttok)
  branch_rows = alone.sent - len(batch.spans)
  assert branch_rows > 0
  shared = _Counted(teacher, len(prompt_t), k=3)
  served = char_served.Served(bank, ((("gen/low",), shared),))
  scores = served.fetch(served.submit(batch.tokens, batch.input_mask))
  plain = _Servers(teacher, len(prompt_t), k=3).submit(batch.tokens, batch.input_mask)[0]
  np.testing.assert_array_equal(scores, np.where(batch.input_mask, plain, 0.0))
  assert shared.sent == len(batch.spans)
  got = cm.targets(served, batch, table, student_tok=stok, teacher_tok=ttok)
  assert shared.sent == len(batch.spans) + branch_rows  # the batch's rows once
  for g, w in zip(got, want):
    if isinstance(g, dict):
      assert g == w
    else:
      np.testing.assert_array_equal(g, w)
  assert not served.kept[id(shared)]  # read back once, then forgotten
  cm.targets(served, batch, table, student_tok=stok, teacher_tok=ttok)
  assert shared.sent == 2 * (len(batch.spans) + branch_rows)  # nothing kept: asked again


def test_a_partial_token_that_is_no_token_branches_in_the_encoders_tokens():
  stok, ttok = tokenizer.CharTokenizer(charset=ALPHABET), PlusTokenizer("three")
  plan = cm.plan_row(cm.CharTable(stok, ttok), stok, ttok, ids=stok.encode("12+"),
                     gen_mask=[1, 1, 1])
  assert [(t.i, t.m, t.partial, t.after_main, t.branch) for t in plan] == [
      (0, 0, b"", False, ()), (1, 0, b"1", False, (ttok.ids["1"],)),
      (2, 0, b"12", False, (ttok.ids["1"], ttok.ids["2"]))]


def test_a_student_of_several_characters_per_token_is_refused():
  with pytest.raises(cm.NotCharacterLevel, match="one token per character"):
    cm.CharTable(PlusTokenizer("pairs"), tokenizer.CharTokenizer(charset=ALPHABET))


def test_the_table_reads_utf8_characters_whole():
  assert list(cm._chars("aé€".encode())) == [(0, b"a"), (1, "é".encode()), (3, "€".encode())]
  assert list(cm._chars("é".encode()[1:] + b"a")) == [(1, b"a")]  # a cut character skipped


def test_teachers_of_two_families_each_read_by_their_own_bank(monkeypatch):
  """`topk_of` on a batch of two families (two teacher tokenizers, two sources): each row's
  targets are those its own family's teacher gives alone, and the loss mask keeps each
  row's generated tokens."""
  from mopd_jax.teachers import bank as bank_mod, families
  from mopd_jax.training import mopd
  stok = tokenizer.CharTokenizer(charset=ALPHABET)
  toks = (PlusTokenizer("pairs"), PlusTokenizer("three"))
  prompt_t = [0 + 1, 3, 6]  # bos, "1", "\n" in both teacher tokenizers
  assert all(t.encode("1\n") == prompt_t[1:] for t in toks)
  oracles = [_oracle(_teacher(_source(k), toks[k]), len(prompt_t)) for k in (0, 1)]
  monkeypatch.setattr(cm, "next_logprobs",
                      lambda cfg, params, tokens, **kw: oracles[params](cfg, params, tokens, **kw))
  rows = ([("1+2\n", True), ("12+1+", False), ("212+", True)],
          [("2+2+2", True), ("12+12", True), ("+\n1", True)])
  alone = [_batch(stok, toks[k], rows[k], prompt_t) for k in (0, 1)]
  w = max(b.arr["tokens"].shape[1] for b in alone)
  wt = max(b.tokens.shape[-1] for b in alone)
  pad = lambda x, n: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n - x.shape[-1])])
  arr = {k: np.concatenate([pad(b.arr[k], w) for b in alone]) for k in ("tokens", "loss_mask")}
  batch = mopd.SampledBatch(
      arr=arr, index=np.arange(6).reshape(2, 3),
      tokens=np.concatenate([pad(b.tokens, wt) for b in alone]),
      input_mask=np.concatenate([pad(b.input_mask, wt) for b in alone]),
      cell_ids=np.zeros(6, int), accuracy=np.zeros(6), lengths=np.zeros(6),
      over=np.zeros(6, bool), spans=alone[0].spans + alone[1].spans,
      alignments=alone[0].alignments + alone[1].alignments, tokenizers=(stok, toks))
  part = lambda k, cell: types.SimpleNamespace(model_cfg=None, params=k,
                                               router=bank_mod.Router((cell,)))
  mixed = families.MixedBank(
      parts=(part(0, "gen/low"), part(1, "gen/max")),
      router=bank_mod.Router(("gen/low", "gen/max")),
      families=tuple(families.Family(tok=t, path=str(k), model_cfg=None, cells=(c,), cross=True)
                     for k, (t, c) in enumerate(zip(toks, ("gen/low", "gen/max")))))
  (lp, ids), mask, counts = cm.topk_of(mixed, batch)
  assert lp.shape == ids.shape == (6, w, stok.vocab_size)
  positions = 0
  for k, b in enumerate(alone):
    want, ok, n = cm.targets(types.SimpleNamespace(model_cfg=None, params=k), b,
                             cm.CharTable(stok, toks[k]), student_tok=stok, teacher_tok=toks[k])
    got = lp[3 * k:3 * k + 3]
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    assert not got[:, want.shape[1]:].any()
    np.testing.assert_array_equal(mask[3 * k:3 * k + 3, :ok.shape[1]], ok & b.arr["loss_mask"])
    positions += n["char_positions"]
  assert counts["char_positions"] == positions == int(mask.sum())
