"""SFT (mopd_jax/training/sft.py): style weights, the domain schedule, the effort tokens of a grid."""
import numpy as np
import pytest

from mopd_jax.io.tokenizer import CharTokenizer
from mopd_jax.tasks import get_task, views
from mopd_jax.training import sft

TOK = CharTokenizer()


def test_sft_style_weights_set_each_domains_style_mix():
  """`sft.style_weights`: a named domain draws (full, brief, direct) in its weights' ratio,
  any other domain uniformly; the draw is a pure function of the rng."""
  exs = {d: get_task(d).generate(0, 200) for d in ("agt", "gen")}
  weights = {"agt": (1.0, 2.0, 1.0)}

  def mix(domain, seed=0):
    batch = sft.sft_batch(TOK, exs[domain], np.random.RandomState(seed), width=256,
                          draw=sft.SftDraw("style", style_weights=weights))
    effort_of = {TOK.effort_id(e): e for e in sft.STYLE_EFFORT.values()}
    firsts = [effort_of[t] for t in np.asarray(batch.tokens).ravel() if t in effort_of]
    return {e: firsts.count(e) / len(firsts) for e in ("max", "high", "low")}

  agt = mix("agt")
  assert abs(agt["high"] - 0.5) < 0.1 and abs(agt["max"] - 0.25) < 0.1, agt
  gen = mix("gen")
  assert all(abs(v - 1 / 3) < 0.1 for v in gen.values()), gen
  assert mix("agt", 1) != agt and mix("agt") == agt
  with pytest.raises(ValueError, match="one per style"):
    sft.sft_batch(TOK, exs["agt"][:2], np.random.RandomState(0), width=256,
                  draw=sft.SftDraw("style", style_weights={"agt": (1.0, 1.0)}))


def test_schedule_follows_the_run_domains():
  known = ("gen", "agt", "cod", "arith")
  assert sft.schedule("", ("gen", "cod"), known) == ["gen", "cod"]  # round-robin
  toy = "gen,cod,agt,gen,cod,agt,gen,cod"
  assert sft.schedule(toy, ("gen", "agt", "cod"), known) == toy.split(",")
  # A sub-grid keeps its domains' places in the sequence and drops the others.
  assert sft.schedule(toy, ("cod", "agt"), known) == ["cod", "agt", "cod", "agt", "cod"]
  with pytest.raises(ValueError, match=r"unknown: \['math'\]"):
    sft.schedule("gen,math", ("gen",), known)
  with pytest.raises(ValueError, match="must name every domain"):
    sft.schedule("gen,gen", ("gen", "arith"), known)
  assert sft.domain_style_weights({"agt": (1, 2, 1), "gen": (1, 1, 1)}, ("agt",), known) == \
      {"agt": (1.0, 2.0, 1.0)}
  with pytest.raises(ValueError, match=r"unknown domains \['math'\]"):
    sft.domain_style_weights({"math": (1, 1, 1)}, ("gen",), known)


def test_random_effort_tokens_come_from_the_grid_efforts():
  tok = CharTokenizer(efforts=("short", "long"))
  exs = get_task("gen").generate(0, 64)
  batch = sft.sft_batch(tok, exs, np.random.RandomState(0), width=64,
                        draw=sft.SftDraw("random", efforts=("short", "long")))
  ids = {tok.effort_id("short"), tok.effort_id("long")}
  used = {int(t) for t in np.asarray(batch.tokens).ravel() if int(t) in ids}
  assert used == ids and int(np.asarray(batch.tokens).max()) < tok.vocab_size


def test_no_effort_share_covers_the_teachers_prompt_format():
  """With effort-free teachers, about one SFT example in |efforts| + 1 has no effort token
  (the teachers' prompt format); without, every example has one. Toy examples keep their
  style draw; a record's single reference is its only style."""
  from mopd_jax.tasks import base
  tok = CharTokenizer()
  exs = get_task("gen").generate(0, 300)
  effort_ids = {tok.effort_id(e) for e in ("low", "high", "max")}

  def without_effort(batch):
    toks = np.asarray(batch.tokens)
    return sum(not (set(row.tolist()) & effort_ids) for row in toks)

  for mode in ("random", "style"):
    with_none = sft.sft_batch(tok, exs, np.random.RandomState(1), width=64,
                              draw=sft.SftDraw(mode, view=views.K3))
    assert 40 < without_effort(with_none) < 110  # ~300 / 4
    assert without_effort(sft.sft_batch(tok, exs, np.random.RandomState(1), width=64,
                                        draw=sft.SftDraw(mode, view=views.EFFORT_EVERYWHERE))) == 0
  rec = base.Example("r", "gen", "1+1", 5, "2", solutions={"full": "#2"})
  batch = sft.sft_batch(tok, [rec], np.random.RandomState(0), width=16,
                        draw=sft.SftDraw("random", view=views.EFFORT_EVERYWHERE))
  text = tok.decode(np.asarray(batch.tokens)[0])  # the toy layout: the effort after <bos>
  assert text.startswith("<bos><") and text[5:].split(">", 1)[1].startswith("1+1\n"), text
  with pytest.raises(ValueError, match="no reference response"):
    sft.sft_batch(tok, [base.Example("s", "gen", "1+1", 5, "2")], np.random.RandomState(0),
                  width=16, draw=sft.SftDraw("random"))
