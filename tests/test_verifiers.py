"""Verifiers of real-format records (mopd_jax/tasks/verifiers.py): math via math-verify,
python_tests in the code sandbox, exact; none of them ever raises."""
import json

import pytest

from mopd_jax.tasks import sandbox, verifiers


@pytest.mark.parametrize("response, answer, want", [
    ("so the result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The answer is \\boxed{\\dfrac{3}{4}}.", "0.75", 1.0),
    ("Half of them: \\boxed{50\\%}", "0.5", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", 72, 1.0),
    ("#### 1,000", "1000", 1.0),
    ("Therefore the answer is 18.", "18", 1.0),
    ("\\boxed{2x+1}", "1+2x", 1.0),
    ("\\boxed{\\sqrt{2}}", "2^{1/2}", 1.0),
    ("first \\boxed{3}, then corrected: \\boxed{4}", "4", 1.0),  # the last one counts
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("I think it is 72 but I am not sure", "72", 0.0),  # no final answer
    ("", "72", 0.0),
    ("\\boxed{", "1", 0.0),  # unbalanced
    ("#### 18", "Janet sells 16 - 3 - 4 = 9 eggs... #### 18", 1.0),  # GSM8K-style gold
])
def test_math(response, answer, want):
  v = verifiers.get("math")
  assert v(response, {"prompt": "p", "answer": answer}) == want
  assert v.errors == 0


def test_math_extraction():
  f = verifiers.final_math_answer
  assert f("\\boxed{\\frac{a}{\\sqrt{b}}} done") == "\\frac{a}{\\sqrt{b}}"
  assert f("x #### 42\nmore") == "42" and f("The answer is: $7$.") == "7"
  assert f("no answer") is None and f(None) is None


GOOD = "Here you go:\n```python\nimport math\n\ndef root_sum(xs):\n" \
       "    return sum(math.isqrt(x) for x in xs)\n```\n"
MBPP = {"prompt": "p", "tests": ["assert root_sum([4, 9]) == 5", "assert root_sum([]) == 0"]}
HUMANEVAL = {"prompt": "p", "entry_point": "root_sum",
             "test": "def check(candidate):\n    assert candidate([16]) == 4\n"
                     "    assert candidate([1, 1]) == 2\n"}


def _backend():
  return "bwrap" if sandbox.bwrap_available() else None


@pytest.mark.skipif(not sandbox.bwrap_available(),
                    reason="imports need the bubblewrap backend (the fallback refuses them)")
@pytest.mark.parametrize("record", [MBPP, HUMANEVAL,
                                    {"prompt": "p", "test": "assert root_sum([9]) == 3\n"}])
def test_python_tests_conventions(record):
  v = verifiers.get("python_tests", backend="bwrap")
  assert v(GOOD, record) == 1.0
  wrong = GOOD.replace("math.isqrt(x)", "x")
  assert v(wrong, record) == 0.0
  assert v("no code at all", record) == 0.0
  assert v.errors == 0


def test_mbpp_literal_asserts_become_hidden_tests():
  hidden = verifiers.code_tests(MBPP)
  assert isinstance(hidden, sandbox.IOTests) and hidden.func == "root_sum"
  assert hidden.pairs == ((([4, 9],), 5), (([],), 0))
  # Anything else runs as a test program.
  assert isinstance(verifiers.code_tests({"tests": ["assert sorted(f(3)) == [1]"]}),
                    sandbox.ProgramTests)
  assert isinstance(verifiers.code_tests(HUMANEVAL), sandbox.ProgramTests)


def test_python_tests_without_imports_on_any_backend():
  v = verifiers.get("python_tests", backend=_backend())
  plain = "```python\ndef root_sum(xs):\n    return sum(int(x ** 0.5) for x in xs)\n```"
  assert v(plain, MBPP) == 1.0
  forged = "```python\nimport os\ndef root_sum(xs):\n    os._exit(73)\n```"
  assert v(forged, MBPP) == 0.0


def test_exact_and_registry():
  v = verifiers.get("exact")
  assert v("so... #18", {"prompt": "p", "answer": "18"}) == 1.0
  assert v("answer: 17", {"prompt": "p", "answer": 18}) == 0.0
  assert set(verifiers.registered()) >= {"math", "python_tests", "exact"}
  with pytest.raises(ValueError, match="unknown verifier 'maths'"):
    verifiers.get("maths")


def test_verifiers_never_raise_and_count_errors():
  v = verifiers.get("math")
  assert v("\\boxed{1}", {"prompt": "p", "answer": ["not", "a", "number"]}) == 0.0
  assert v("\\boxed{1}", {"prompt": "p"}) == 0.0  # missing answer: counted, not raised
  assert v.errors == 2 and "KeyError" in v.last_error
  code = verifiers.get("python_tests")
  assert code(GOOD, {"prompt": "p"}) == 0.0 and code.errors == 1


def test_check_record_names_the_missing_field():
  assert verifiers.get("math").check_record({"prompt": "p"}) == \
      "verifier 'math' needs field 'answer'"
  assert "needs field 'test' or 'tests'" in verifiers.get("python_tests").check_record(
      {"prompt": "p", "entry_point": "f"})
  assert verifiers.get("exact").check_record({"answer": 1}) == \
      "missing or empty field 'prompt'"
  assert verifiers.get("exact").check_record({"prompt": "p", "answer": 3}) is None


TOOL_RECORD = {"prompt": "How long is the river Oskel, in km?", "answer": 412,
               "tools": {"documents": {"River Oskel": "The river Oskel is 412 km long.",
                                       "Town Oskel": "Oskel has 3 thousand people."},
                         "calculator": True}}


@pytest.mark.parametrize("response, want", [
    ('<tool_call>{"name": "lookup", "arguments": {"title": "River Oskel"}}</tool_call>'
     "<tool_response>The river Oskel is 412 km long.</tool_response>It is 412 km.\n#### 412", 1.0),
    ("<tool_call>{}</tool_call><tool_response>error: ...</tool_response>"
     "The answer is 412.", 1.0),
    ("\\boxed{412}", 1.0),
    # The number in the observation is not an answer: only the text after it counts.
    ("<tool_call>x</tool_call><tool_response>#### 412</tool_response>I do not know.", 0.0),
    ("#### 413", 0.0),
    ("no final answer", 0.0),
])
def test_tool_final_answer(response, want):
  assert verifiers.get("tool")(response, TOOL_RECORD) == want


def test_tool_environment_runs_calls_and_answers_malformed_ones_with_errors():
  from mopd_jax.tasks import base, tools
  env = tools.ToolEnvironment(("<obs>", "</obs>"))
  ex = base.Example("t", "tool", "q", 9, "412", meta={"record": TOOL_RECORD})
  call = lambda name, **a: json.dumps({"name": name, "arguments": a})
  assert env.step(ex, call("search", query="oskel river")) == '<obs>["River Oskel"]</obs>'
  assert env.step(ex, call("search", query="zzz")) == "<obs>no results</obs>"
  assert env.step(ex, call("lookup", title="Town Oskel")) == "<obs>Oskel has 3 thousand people.</obs>"
  assert env.step(ex, call("calculator", expression="412 + 3 * (2 - 1)")) == "<obs>415</obs>"
  for bad, why in [("not json", "not JSON"), (call("rm", path="/"), "no tool named 'rm'"),
                   (call("calculator", expression="__import__('os')"), "unsupported"),
                   (call("calculator", expression="9**9**9"), "too large"),
                   (call("calculator", expression="1/0"), "division by zero"),
                   (call("lookup", title="</obs>"), "no document"),
                   ('{"name": "search", "arguments": [1]}', "must be an object"),
                   ("[" * 100000, "not JSON"), (None, "error")]:
    out = env.step(ex, bad)
    assert out.startswith("<obs>error: ") and why in out and out.count("</obs>") == 1, out
  no_tools = base.Example("u", "tool", "q", 9, "1", meta={"record": {"prompt": "q"}})
  assert env.step(no_tools, call("search", query="x")) == "<obs>error: this task has no tools</obs>"


def test_tool_records_are_checked():
  v = verifiers.get("tool")
  assert v.check_record(TOOL_RECORD) is None
  assert "needs field 'tools'" in v.check_record({"prompt": "p", "answer": 1})
  assert "defines no tool" in v.check_record({"prompt": "p", "answer": 1, "tools": {}})
  assert "unknown key(s) ['shell']" in v.check_record(
      {"prompt": "p", "answer": 1, "tools": {"shell": True}})
