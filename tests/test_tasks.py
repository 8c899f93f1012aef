"""The task interface, the three toy domains, the TFDS datasets and the JSONL reader."""
import json
import re
import sys

import numpy as np
import pytest

from configs import toy
from mopd_jax import tasks
from mopd_jax.io.tokenizer import CharTokenizer
from mopd_jax.tasks import base, cod, datasets, jsonl, sandbox
import toy_grid

TOK = CharTokenizer()
N = 400  # examples per domain in the generator tests
TAUS = {name: block.tau for name, block in toy.get_config().effort.items()}  # the toy config's
# Length caps that keep toy sequences short (characters; a special token counts once).
MAX_PROMPT, MAX_LEN = 64, dict(full=90, brief=56, direct=15)


@pytest.fixture(scope="module", params=toy_grid.DOMAINS)
def domain_examples(request):
  task = tasks.get_task(request.param)
  return task, task.generate(seed=0, n=N)


def ntok(text):
  return len(TOK.encode(text))


def check_verifier_contract(task, examples):
  """What every generated task's verifier owes: each reference style scores 1, the task's
  own `wrong_response` (the right shape, a wrong final answer) and answerless text score 0,
  the answer is read after the last `#`, and nothing raises."""
  for ex in examples:
    wrong = task.wrong_response(ex)
    for style in tasks.STYLES:
      assert task.verify(ex, ex.solutions[style]) == 1.0, (style, ex.solutions[style])
    assert task.verify(ex, wrong) == 0.0, wrong
    assert task.verify(ex, "") == 0.0
    assert task.verify(ex, "no answer marker " + ex.answer) == 0.0
    # The answer is parsed from the last `#`; an EOS and what follows are ignored.
    assert task.verify(ex, ex.solutions["direct"] + "<eos><pad><pad>") == 1.0
    assert task.verify(ex, wrong + "\n" + ex.solutions["direct"]) == 1.0
    assert task.verify(ex, ex.solutions["direct"] + "\n" + wrong) == 0.0
  assert task.num_verify_errors == 0


# --- the interface ----------------------------------------------------------------------------
def test_registry_and_names():
  for d in toy_grid.DOMAINS:
    t = tasks.get_task(d)
    assert t.name == d and (t.environment is not None) == (d == "agt")
  assert tasks.get_task("gen") is not tasks.get_task("gen")  # fresh counters per instance
  with pytest.raises(ValueError, match=r"unknown task 'math'; registered: \['agt', 'cod', "):
    tasks.get_task("math")
  assert set(toy_grid.DOMAINS) <= set(tasks.registered())
  relabelled = tasks.get_task("gen", domain="arith").generate(0, 2)
  assert all(ex.domain == "arith" and ex.uid.startswith("arith-") for ex in relabelled)
  with pytest.raises(ValueError, match="not a valid domain name"):
    tasks.get_task("gen", domain="a/b")
  ex = tasks.get_task("gen").generate(0, 1)[0]
  with pytest.raises(ValueError, match="no tau configured"):
    tasks.effort_budget(ex, "turbo", TAUS)
  with pytest.raises(ValueError, match="no tau configured"):
    tasks.effort_budget(ex, "low", dict(max=1.0))
  assert tasks.effort_budget(ex, "max", dict(TAUS, max=1.0)) == ex.b0
  with pytest.raises(ValueError, match="tau"):
    tasks.budget(ex, 0.0)


def test_generation_is_deterministic_with_distinct_prompts(domain_examples):
  task, exs = domain_examples
  again = tasks.get_task(task.name).generate(seed=0, n=N)
  assert [e.to_json() for e in exs] == [e.to_json() for e in again]
  other = task.generate(seed=1, n=50)
  assert [e.prompt for e in other] != [e.prompt for e in exs[:50]]
  assert len({e.prompt for e in exs}) == N
  assert len({e.uid for e in exs}) == N
  excluded = task.generate(seed=0, n=20, exclude={e.prompt for e in exs[:10]})
  assert not {e.prompt for e in excluded} & {e.prompt for e in exs[:10]}


def test_examples_are_json_and_fit_the_toy_model(domain_examples):
  task, exs = domain_examples
  for ex in exs:
    assert base.Example.from_json(ex.to_json()) == ex
    assert ex.domain == task.name and set(ex.solutions) == set(tasks.STYLES)
    for text in [ex.prompt, ex.answer, *ex.solutions.values()]:
      TOK.encode(text)  # raises on a character outside the charset
    assert len(ex.prompt) <= MAX_PROMPT, ex.prompt
    for style, cap in MAX_LEN.items():
      assert ntok(ex.solutions[style]) <= cap, (style, ex.solutions[style])
      assert ex.solutions[style].endswith("#" + ex.answer)


def test_every_style_verifies_and_wrong_answers_do_not(domain_examples):
  task, exs = domain_examples
  check_verifier_contract(task, exs[:60])
  if task.name == "cod":
    assert task.num_sandbox_runs == 0  # every generated or wrong response took the fast path


def test_lengths_order_styles_and_budgets_select_them(domain_examples):
  task, exs = domain_examples
  # Every domain's styles differ at their first token, where the effort token predicts the
  # style (a choice made later has to look back past the trace to it).
  for e in exs:
    assert len({TOK.encode(e.solutions[s])[0] for s in tasks.STYLES}) == 3, e.solutions
  lens = {s: np.array([ntok(e.solutions[s]) for e in exs]) for s in tasks.STYLES}
  assert np.all(lens["full"] > lens["brief"]) and np.all(lens["brief"] > lens["direct"])
  assert lens["full"].mean() >= 1.3 * lens["brief"].mean()
  b0 = np.array([e.b0 for e in exs])
  assert np.all(lens["full"] + 1 <= b0)  # + EOS
  fits = lambda s, tau: np.mean([ntok(e.solutions[s]) + 1 <= tasks.budget(e, tau)
                                 for e in exs])
  assert fits("full", TAUS["max"]) == 1.0
  assert fits("full", TAUS["high"]) == 0.0 and fits("full", TAUS["low"]) == 0.0
  assert fits("brief", TAUS["low"]) == 0.0
  assert fits("direct", TAUS["low"]) == 1.0
  assert fits("brief", TAUS["high"]) == 1.0


def test_verifier_exceptions_score_zero_and_are_counted():
  gen = tasks.get_task("gen")
  ex = gen.generate(0, 1)[0]
  broken = base.Example(uid="x", domain="gen", prompt="1+1=?", b0=5, answer="not a number")
  assert gen.verify(broken, "#2") == 0.0
  assert gen.num_verify_errors == 1 and "ValueError" in gen.last_verify_error
  assert gen.verify(ex, None) == 0.0 and gen.verify(ex, 12345) == 0.0  # not a str
  c = tasks.get_task("cod")
  no_tests = base.Example(uid="y", domain="cod", prompt="f(1)=2", b0=9, answer="1*x+1")
  assert c.verify(no_tests, "#1*x+1") == 0.0 and c.num_verify_errors == 1

  class Flaky(base.Task):
    name = "flaky"

    def _verify(self, example, response):
      return {"nan": float("nan"), "big": 2.0}.get(response) or 1 / 0

  f = Flaky()
  assert [f.verify(ex, r) for r in ("nan", "big", "zero")] == [0.0, 0.0, 0.0]
  assert f.counters() == dict(verify_calls=3, verify_errors=3)


# --- bad input ------------------------------------------------------------------------------
def test_bad_examples_are_refused():
  kw = dict(uid="u", domain="gen", b0=10, answer="1")
  with pytest.raises(tasks.DataError, match="empty prompt"):
    base.Example(prompt="  \n", **kw)
  with pytest.raises(tasks.DataError, match="not valid UTF-8"):
    base.Example(prompt="abc\udcff", **kw)  # a non-UTF-8 byte smuggled in by surrogateescape
  with pytest.raises(tasks.DataError, match="not valid UTF-8"):
    tasks.check_text(b"\xff\xfe", "prompt")
  assert tasks.check_text("ok".encode(), "prompt") == "ok"
  assert base.Example(prompt="p", **{**kw, "domain": "math"}).domain == "math"  # any name
  with pytest.raises(ValueError, match="not a valid domain name"):
    base.Example(prompt="p", **{**kw, "domain": "gen/max"})
  with pytest.raises(tasks.DataError, match="unknown style"):
    base.Example(prompt="p", solutions={"long": "x"}, **kw)
  with pytest.raises(tasks.DataError, match="b0"):
    base.Example(prompt="p", **{**kw, "b0": 0})


def test_prompt_length_error_or_counted_skip():
  exs = [e for d in toy_grid.DOMAINS for e in tasks.get_task(d).generate(0, 10)]
  cap = max(len(e.prompt) for e in exs) - 1
  with pytest.raises(tasks.DataError, match="over the maximum"):
    tasks.check_prompt_length(exs, cap, on_too_long="error")
  kept, skipped = tasks.check_prompt_length(exs, cap, on_too_long="skip")
  assert 0 < skipped < 30 and len(kept) + skipped == 30
  assert all(len(e.prompt) <= cap for e in kept)
  assert all(e in exs for e in kept)  # dropped whole, never truncated
  kept, skipped = tasks.check_prompt_length(exs, cap, tokenizer=TOK, on_too_long="skip")
  assert all(ntok(e.prompt) <= cap for e in kept)
  assert tasks.check_prompt_length(exs, None) == (exs, 0)
  with pytest.raises(ValueError, match="on_too_long"):
    tasks.check_prompt_length(exs, cap, on_too_long="truncate")


# --- agt: the environment ---------------------------------------------------------------------
def test_agt_environment_replays_the_full_solution():
  task = tasks.get_task("agt")
  env = task.environment
  fewer = 0
  for ex in task.generate(3, 50):
    for style in ("full", "brief"):
      sol = ex.solutions[style]
      # What a rollout does: decode to `</call>`, ask the environment, insert its answer.
      pieces = re.findall(r"<call>(.*?)</call>(<obs>.*?</obs>)", sol)
      assert len(pieces) == sol.count("<call>")
      for call, obs in pieces:
        assert env.step(ex, call) == obs
    assert ex.solutions["full"].count("<call>") == len(ex.meta["chain"]) - 1
    # Brief calls only the hops the memo does not answer correctly (all of them if every
    # memo fact on the chain is stale).
    calls = {s: ex.solutions[s].count("<call>") for s in tasks.STYLES}
    assert calls["full"] >= calls["brief"] >= 1 and calls["direct"] == 0
    fewer += calls["brief"] < calls["full"]
  assert fewer >= 40


def test_agt_environment_never_raises():
  task = tasks.get_task("agt")
  ex = task.generate(0, 1)[0]
  env = task.environment
  root = next(n for n, b in ex.meta["boss"].items() if b is None)
  start = ex.meta["chain"][0]
  assert env.step(ex, f"<call>boss({start})</call>") == f"<obs>{ex.meta['chain'][1]}</obs>"
  assert env.step(ex, f" boss( {start} ) ") == f"<obs>{ex.meta['chain'][1]}</obs>"
  assert env.step(ex, f"boss({root})") == "<obs>none</obs>"
  assert env.step(ex, "boss(zzz)") == "<obs>error: unknown name</obs>"
  for bad in ("", "boss()", "fire(ann)", "boss(ann", "boss(ann);boss(bob)", "x" * 10_000,
              "boss(\udcff)", None, 17):
    assert env.step(ex, bad) == "<obs>error: bad call</obs>", bad
  no_world = base.Example(uid="z", domain="agt", prompt="boss(ann)?", b0=9, answer="bob")
  assert env.step(no_world, "boss(ann)") == "<obs>error: bad call</obs>"
  for e in task.generate(0, 50):  # every error observation is in the toy charset
    TOK.encode(env.step(e, "boss(zzz)") + env.step(e, "?"))


def test_agt_memo_is_a_possibly_stale_prefix_of_the_chain():
  exs = tasks.get_task("agt").generate(0, N)
  stale = 0
  for ex in exs:
    chain, boss, memo = ex.meta["chain"], ex.meta["boss"], ex.meta["memo"]
    assert chain[-1] == ex.answer and all(boss[a] == b for a, b in zip(chain, chain[1:]))
    assert memo[:-1] == chain[:len(memo) - 1]  # right but for, possibly, its last name
    stale += memo[-1] != chain[len(memo) - 1]
    assert ex.answer not in ex.prompt  # nobody above the memo is named: direct must guess
  assert 0.2 < stale / N < 0.4


def test_gen_running_sums_are_aligned_with_the_terms():
  stale = 0
  for ex in tasks.get_task("gen").generate(0, N):
    terms, values, memo = ex.meta["terms"], ex.meta["values"], ex.meta["memo"]
    assert ex.prompt == "+".join(map(str, terms)) + f" mod 3 s4={memo}"
    assert values[-1] == sum(terms) % 3 == int(ex.answer)
    # full writes one value per term, at the same stride as the prompt's terms; brief the
    # same stride from the half-sum the memo claims (written true, copied from the memo)
    assert ex.solutions["full"].split("\n")[0] == ",".join(map(str, values))
    assert ex.solutions["brief"].split("\n")[0] == "~" + ",".join(map(str, values[3:]))
    stale += memo != values[3]
  assert 0.2 < stale / N < 0.4
  with pytest.raises(ValueError, match="memo"):
    tasks.get_task("gen").make([1, 2, 0, 1], memo=3)


def test_gen_pairs_writes_each_term_before_its_running_sum():
  """`gen_pairs`: the same problems and answers as `gen`; full writes term j and then the
  running sum after it (two characters a step, the prompt's stride), brief the memo's value
  and then the pairs of the last four terms."""
  for plain, pairs in zip(tasks.get_task("gen").generate(0, 50),
                          tasks.get_task("gen_pairs").generate(0, 50)):
    terms, values = pairs.meta["terms"], pairs.meta["values"]
    assert (pairs.prompt, pairs.answer, pairs.solutions["direct"]) == (
        plain.prompt, plain.answer, plain.solutions["direct"])
    steps = [f"{t}{v}" for t, v in zip(terms, values)]
    assert pairs.solutions["full"] == "".join(steps) + "\n#" + pairs.answer
    assert pairs.solutions["brief"] == "~" + str(values[3]) + "".join(steps[4:]) + "\n#" + \
        pairs.answer
    task = tasks.get_task("gen_pairs")
    assert all(task.verify(pairs, pairs.solutions[s]) == 1.0 for s in pairs.solutions)


@pytest.mark.parametrize("name,uniform", [("gen", "gen_uniform"), ("cod", "cod_uniform")])
def test_running_sum_digits_are_zero_half_the_time(name, uniform):
  """`gen`'s terms and `cod`'s digits after a literal's first are 0 with probability
  `base.ZERO_PROB` (the others equally likely), so a trace step's next value repeats the
  previous one half the time; the answers stay uniform, so a guess is still right a third of
  the time. The `_uniform` variants draw every digit uniformly, with the same answers'
  distribution."""
  assert base.ZERO_PROB == 0.5

  def digits(ex):
    if name == "gen":
      return ex.meta["terms"]
    code = ex.prompt.split("#")[0]
    return [int(c) for lit in (code.split("%")[0], code.split("+")[1].split("%")[0])
            for c in lit[1:]]

  for task_name, zero in ((name, 0.5), (uniform, 1 / 3)):
    exs = tasks.get_task(task_name, domain=name).generate(0, 600)  # few repeats to drop
    ds = np.concatenate([digits(ex) for ex in exs])
    counts = np.bincount(ds, minlength=3) / len(ds)
    assert counts[0] == pytest.approx(zero, abs=0.03), (task_name, counts)
    assert counts[1] == pytest.approx(counts[2], abs=0.04), (task_name, counts)
    answers = [ex.answer for ex in exs]
    shares = [answers.count(a) / len(answers) for a in sorted(set(answers))]
    assert max(shares) - min(shares) < 0.1, (task_name, shares)


def test_draw_digits_refuses_nothing_and_covers_the_base():
  rng = np.random.default_rng(0)
  assert set(base.draw_digits(rng, 3, 500, zero_prob=0.5)) == {0, 1, 2}
  assert set(base.draw_digits(rng, 3, 500, zero_prob=None)) == {0, 1, 2}
  assert base.draw_digits(rng, 3, 0, zero_prob=0.5) == []


def test_cod_programs_compute_their_answer():
  task = tasks.get_task("cod")
  stale = 0
  for ex in task.generate(0, 200):
    code, claim = ex.prompt.split("#b=")
    for x, y in ex.meta["tests"][:2]:
      assert eval(code, {"x": x}) == y  # trusted: the generator's own program
    stale += int(claim) != ex.meta["b"]
  assert 0.2 < stale / 200 < 0.4
  with pytest.raises(ValueError, match="decimal literal"):
    task.make("012", "1", 0, test_x=[1])


# --- cod: fast path and sandbox ------------------------------------------------------------------
def test_cod_fast_path_agrees_with_the_sandbox():
  task = tasks.get_task("cod")
  exs = task.generate(0, 3)
  for ex in exs:
    for expr in (ex.answer, cod.canonical_expr(ex.meta["a"], ex.meta["b"] - 1)):
      fast = task.verify(ex, "#" + expr)
      slow = sandbox.reward(cod.expr_program(expr), [tuple(t) for t in ex.meta["tests"]])
      assert fast == slow
  assert task.num_sandbox_runs == 0 and task.num_fast_path == 6


def test_cod_verify_batch_pools_the_sandbox_and_equals_verify():
  task = tasks.get_task("cod", workers=2)
  exs = task.generate(0, 4)
  responses = []
  for ex in exs:
    a, b = ex.meta["a"], ex.meta["b"]
    responses += [f"#x*{a}+({b})", f"#x*{a}+({b})+1", "#" + ex.answer, "no answer"]
  rows = [ex for ex in exs for _ in range(4)]
  one_by_one = tasks.get_task("cod")
  want = [one_by_one.verify(ex, r) for ex, r in zip(rows, responses)]
  assert task.verify_batch(rows, responses) == want == [1.0, 0.0, 1.0, 0.0] * 4
  assert task.num_sandbox_runs == 8 and task.num_verify_calls == 16
  assert task.verify_unless(rows, responses, [i % 2 for i in range(16)], fill=-1.0) == \
      [1.0, -1.0, 1.0, -1.0] * 4
  assert task.num_sandbox_runs == 8  # the rows it scored were cached; skipped rows not run


def test_cod_other_programs_go_to_the_sandbox():
  task = tasks.get_task("cod")
  ex = task.generate(0, 1)[0]
  a, b = ex.meta["a"], ex.meta["b"]
  canonical_code = f"<code>def f(x):\n    return {cod.canonical_expr(a, b)}</code>"
  assert task.verify(ex, "thinking...\n" + canonical_code) == 1.0
  assert task.num_sandbox_runs == 0  # a canonical <code> body is also fast
  assert task.verify(ex, f"#x*{a}+({b})") == 1.0  # equivalent, not canonical: sandboxed
  assert task.verify(ex, f"#x*{a}+({b})") == 1.0  # cached
  assert task.num_sandbox_runs == 1 and task.num_cache_hits == 1
  loop_code = (f"<code>def f(x):\n    y = {b}\n    for _ in range(abs(x)):\n"
               f"        y += {a} if x > 0 else -{a}\n    return y</code>")
  assert task.verify(ex, loop_code) == 1.0
  assert task.verify(ex, f"#x*{a}+({b})+1") == 0.0
  for hostile in ("#__import__('os').system('touch /tmp/pwned')", "#open('/etc/passwd')",
                  "#x\nimport os", "#x; import os", "#" + "x+" * 300 + "1", "#3*x+",
                  "<code>import os\ndef f(x):\n    return 1</code>", "<code></code>"):
    assert task.verify(ex, hostile) == 0.0, hostile
  assert task.num_verify_errors == 0
  assert cod.expr_program("x; import os") is None
  assert cod.parse_canonical("03*x+1") is None and cod.parse_canonical("3*x+-1") is None
  assert cod.parse_canonical("-3*x-12") == (-3, -12)


# --- datasets ------------------------------------------------------------------------------------
SIZES = (300, 60, 60)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tfds")
  for domain in toy_grid.DOMAINS:
    datasets.prepare(domain, str(d), seed=0, sizes=SIZES)
  return str(d)


def test_tfds_builds_without_tensorflow(data_dir):
  del data_dir
  assert "tensorflow" not in sys.modules


@pytest.mark.parametrize("domain", toy_grid.DOMAINS)
def test_tfds_splits_are_disjoint_and_match_the_generator(data_dir, domain):
  splits = {s: datasets.load_split(domain, s, data_dir, sizes=SIZES) for s in datasets.SPLITS}
  assert [len(splits[s]) for s in datasets.SPLITS] == list(SIZES)
  prompts = {s: {ex.prompt for ex in src.__getitems__(range(len(src)))}
             for s, src in splits.items()}
  assert [len(p) for p in prompts.values()] == list(SIZES)
  assert not prompts["train"] & prompts["validation"]
  assert not prompts["train"] & prompts["test"]
  assert not prompts["validation"] & prompts["test"]
  # Disjoint by underlying problem too, not only by prompt string.
  task = tasks.get_task(domain)
  keys = {s: {task.problem_key(ex) for ex in src.__getitems__(range(len(src)))}
          for s, src in splits.items()}
  assert not keys["train"] & keys["validation"]
  assert not (keys["train"] | keys["validation"]) & keys["test"]
  train = splits["train"]
  assert isinstance(train[0], base.Example) and train[0].domain == domain
  assert [train[i] for i in range(5)] == tasks.get_task(domain).generate(0, 5)  # in order


@pytest.mark.parametrize("domain", toy_grid.DOMAINS)
def test_problem_keys_ignore_what_does_not_change_the_answer(domain):
  """Examples with one problem key have one answer, and the generators do repeat problems
  under other prompts (a memo, a comment), which is why splits exclude keys, not prompts."""
  task = tasks.get_task(domain)
  exs = task.generate(0, 4000)
  by_key = {}
  for ex in exs:
    by_key.setdefault(task.problem_key(ex), set()).add(ex.answer)
  assert all(len(answers) == 1 for answers in by_key.values())
  if domain != "agt":  # gen and cod repeat problems within 4000 draws
    assert len(by_key) < len(exs)


def test_tfds_is_deterministic(data_dir, tmp_path):
  other = datasets.load_split("cod", "test", str(tmp_path), sizes=SIZES)
  mine = datasets.load_split("cod", "test", data_dir, sizes=SIZES)
  assert [e.to_json() for e in other.__getitems__(range(60))] == \
      [e.to_json() for e in mine.__getitems__(range(60))]
  assert datasets.make_config("gen").name == "gen"
  assert datasets.make_config("gen", seed=1).name != datasets.make_config("gen", seed=2).name
  with pytest.raises(ValueError, match="unknown task 'math'"):
    datasets.make_config("math")
  # A domain of another name runs a registered task: its own config, examples labelled so.
  assert datasets.make_config("arith", task="gen").name == "arith_gen"
  assert datasets.make_config("gen", task="gen").name == "gen"
  with pytest.raises(ValueError, match="unknown split"):
    datasets.load_split("gen", "dev", data_dir, sizes=SIZES)


def _uids(batches):
  return [[e.uid for e in b] for b in batches]


def test_resumable_iterator_restores_exactly(data_dir):
  src = datasets.load_split("gen", "validation", data_dir, sizes=SIZES)  # 60 examples
  it = datasets.ResumableIterator(src, batch_size=7, seed=3)
  first = _uids(next(it) for _ in range(4))
  state = json.loads(json.dumps(it.state()))  # must survive a JSON checkpoint
  assert state["epoch"] == 0 and state["position"] == 28
  rest = _uids(next(it) for _ in range(20))  # crosses two epoch boundaries
  again = datasets.ResumableIterator(src, batch_size=7, seed=3)
  again.restore(state)
  assert _uids(next(again) for _ in range(20)) == rest
  # Batches are full; each epoch is a permutation; epochs differ; seeds differ.
  flat = sum(first + rest, [])
  assert all(len(b) == 7 for b in first + rest)
  assert sorted(flat[:60]) == sorted(flat[60:120]) == sorted(e.uid for e in
                                                              src.__getitems__(range(60)))
  assert flat[:60] != flat[60:120]
  other_seed = datasets.ResumableIterator(src, batch_size=7, seed=4)
  assert _uids([next(other_seed)]) != first[:1]
  with pytest.raises(ValueError, match="seed"):
    datasets.ResumableIterator(src, 7, seed=4).restore(state)
  with pytest.raises(ValueError, match="num_examples"):
    datasets.ResumableIterator(datasets.load_split("gen", "train", data_dir, sizes=SIZES), 7,
                               seed=3).restore(state)


def test_resumable_iterator_finite_and_unshuffled(data_dir):
  src = datasets.load_split("agt", "test", data_dir, sizes=SIZES)
  it = datasets.ResumableIterator(src, batch_size=25, seed=0, shuffle=False, num_epochs=1)
  batches = list(it)
  assert [len(b) for b in batches] == [25, 25, 10]
  assert [e.uid for b in batches for e in b] == [src[i].uid for i in range(60)]
  with pytest.raises(StopIteration):
    next(it)
  plain = datasets.ResumableIterator([src[i] for i in range(10)], 4, seed=0)  # any sequence
  assert len(next(plain)) == 4
  with pytest.raises(ValueError, match="empty"):
    datasets.ResumableIterator([], 4, seed=0)
  with pytest.raises(ValueError, match="batch_size"):
    datasets.ResumableIterator(src, 0, seed=0)


# --- JSONL ---------------------------------------------------------------------------------------
GSM = [
    {"prompt": "Tom has 3 apples and buys 4 more. How many?",
     "answer": "He has 3+4=7 apples.\n#### 7"},
    {"prompt": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "2,400",
     "domain": "gen", "budget": 64, "id": "q2"},
    {"prompt": "Name the capital of France.", "answer": "Paris", "domain": "agt"},
]


def write_lines(path, lines):
  with open(path, "wb") as fh:
    for line in lines:
      fh.write(line if isinstance(line, bytes) else (line + "\n").encode())
  return str(path)


def test_jsonl_reads_a_gsm8k_style_file(tmp_path):
  path = write_lines(tmp_path / "gsm.jsonl", [json.dumps(GSM[0]), "", json.dumps(GSM[1]),
                                             "   ", json.dumps(GSM[2])])
  data = jsonl.load_jsonl(path)
  assert [e.uid for e in data.examples] == ["gsm.jsonl:1", "gsm.jsonl:3", "gsm.jsonl:5"]
  assert data.num_blank == 2 and data.num_skipped_too_long == 0 and data.num_lines == 5
  e0, e1, e2 = data.examples
  assert (e0.domain, e0.answer, e0.solutions["full"]) == ("gen", "7", GSM[0]["answer"])
  assert e0.b0 == int(np.ceil(1.1 * (len(GSM[0]["answer"]) + 1)))
  assert e1.b0 == 64 and e1.meta["id"] == "q2" and e2.domain == "agt" and e2.b0 == 256
  task = jsonl.JsonlTask()
  assert task.verify(e0, e0.solutions["full"]) == 1.0
  assert task.verify(e0, "so 7.0 apples\n#  7 ") == 1.0
  assert task.verify(e0, "The answer: 7.") == 1.0
  assert task.verify(e0, "#8") == 0.0 and task.verify(e0, "7") == 0.0
  assert task.verify(e1, "Answer: $2,400.") == 1.0 and task.verify(e1, "#2400.00") == 1.0
  assert task.verify(e1, "#24,00") == 1.0  # commas are dropped before comparing
  assert task.verify(e1, "#2401") == 0.0
  assert task.verify(e2, "#  paris") == 1.0 and task.verify(e2, "#Lyon") == 0.0
  assert task.verify(e2, "#") == 0.0
  assert task.num_verify_errors == 0
  with_tok = jsonl.load_jsonl(path, tokenizer=TOK)
  assert with_tok.examples[0].b0 == tasks.compute_b0(GSM[0]["answer"])


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "p", "answer": "1"', "malformed JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"answer": "1"}', "missing field 'prompt'"),
    ('{"prompt": "p"}', "missing field 'answer'"),
    ('{"prompt": 3, "answer": "1"}', "'prompt' must be a string"),
    ('{"prompt": "p", "answer": null}', "'answer' must be"),
    ('{"prompt": "  ", "answer": "1"}', "empty prompt"),
    ('{"prompt": "p", "answer": "1", "domain": "math"}', "unknown domain"),
    ('{"prompt": "p", "answer": "1", "budget": 0}', "'budget' must be a positive int"),
    (b'{"prompt": "caf\xe9", "answer": "1"}\n', "not valid UTF-8"),
    ('{"prompt": "bad \\udcff", "answer": "1"}', "prompt is not valid UTF-8"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    ('{"prompt": "p", "answer": ' + "9" * 5000 + "}", "unreadable JSON value"),
    ('{"prompt": "p", "answer": NaN}', "'answer' must be a finite number"),
    ('{"prompt": "p", "answer": Infinity}', "'answer' must be a finite number"),
    ('{"prompt": "p", "answer": "1", "domain": ["gen"]}', "unknown domain"),
    ('{"prompt": "p", "answer": "1", "budget": 2.5}', "'budget' must be a positive int"),
    ('{"prompt": "p", "answer": "1", "budget": true}', "'budget' must be a positive int"),
    ('{"prompt": "p", "answer": {"x": 1}}', "'answer' must be"),
    ('"just a string"', "expected a JSON object"),
    ("\x00\x01", "malformed JSON"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
  path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GSM[0]), "", line, json.dumps(GSM[1])])
  with pytest.raises(tasks.DataError, match=re.escape(f"bad.jsonl:3: {message}")):
    jsonl.load_jsonl(path)


def test_jsonl_missing_file_or_directory_is_a_data_error(tmp_path):
  with pytest.raises(tasks.DataError, match="nope.jsonl: no such file"):
    jsonl.load_jsonl(tmp_path / "nope.jsonl")
  with pytest.raises(tasks.DataError, match="a directory"):
    jsonl.load_jsonl(tmp_path)


def test_jsonl_too_long_prompts_error_or_are_counted(tmp_path):
  path = write_lines(tmp_path / "long.jsonl", [json.dumps(r) for r in GSM])
  with pytest.raises(tasks.DataError, match=r"long.jsonl:2: prompt has 50 characters"):
    jsonl.load_jsonl(path, max_prompt_len=45)
  data = jsonl.load_jsonl(path, max_prompt_len=45, on_too_long="skip")
  assert data.num_skipped_too_long == 1 and data.skipped_lines == [2]
  assert [e.prompt for e in data.examples] == [GSM[0]["prompt"], GSM[2]["prompt"]]  # untouched
  with pytest.raises(ValueError, match="on_too_long"):
    jsonl.load_jsonl(path, on_too_long="truncate")
  with pytest.raises(ValueError, match="unknown domain"):
    jsonl.load_jsonl(path, default_domain="math")


def test_grain_iterator_resumes_exactly_and_refuses_another_stream():
  """Record domains' iterator (grain, sharded by JAX process; one process here): endless
  shuffled batches, every example once per epoch, and a restored state continues with the
  very batches the saved one would have produced. The 2-process case is in
  tests/test_multihost.py."""
  exs = tasks.get_task("gen").generate(0, 30)
  it = datasets.GrainIterator(exs, 6, seed=4)
  epoch = [e.uid for _ in range(5) for e in next(it)]
  assert sorted(epoch) == sorted(e.uid for e in exs)  # 5 x 6 = one epoch, each once
  state = json.loads(json.dumps(it.state()))  # what the checkpoint stores
  ahead = [next(it) for _ in range(7)]
  back = datasets.GrainIterator(exs, 6, seed=4)
  back.restore(state)
  assert [next(back) for _ in range(7)] == ahead
  with pytest.raises(ValueError, match="seed"):
    datasets.GrainIterator(exs, 6, seed=5).restore(state)
  with pytest.raises(ValueError, match="multiple of the 1 process"):
    datasets.GrainIterator(exs, 0, seed=4)
