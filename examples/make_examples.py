"""Writes the small real-format example data of `examples/spec.json` (run from the repo root):

    python examples/make_examples.py

tool: questions answered by looking facts up in a small per-record document store (`search`,
`lookup`) and adding them with a `calculator`, in Qwen's tool-call format; the reference
solution holds the calls and the observations the environment returns.
math: GSM8K-style word problems (`prompt`, `answer`, `solution` ending in `#### N`; a few
answers are fractions written in LaTeX). code: MBPP-style records (`tests`, a list of assert
lines, and `canonical_solution`) in Parquet for train, and HumanEval-style ones (a `test`
program defining `check(candidate)`, `entry_point`) mixed into the JSONL test file; some
reference solutions import the standard library or define a class. Every problem is drawn
once: the test files share no problem with train. Deterministic (seeded).
"""
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))

_MATH = [
    ("{a} boxes hold {b} apples each. {c} apples are eaten. How many apples are left?",
     lambda a, b, c: a * b - c,
     "{a} boxes * {b} apples = {ab} apples. {ab} - {c} = {r}."),
    ("A shop sells pens at {b} dollars each. Ana buys {a} pens and pays with a {p}-dollar "
     "bill. How much change does she get?",
     lambda a, b, c: (a * b + c) - a * b,
     "The pens cost {a} * {b} = {ab} dollars. {p} - {ab} = {r}."),
    ("A train travels {a} km every hour for {b} hours, then {c} km more. How far does it go?",
     lambda a, b, c: a * b + c,
     "{a} * {b} = {ab} km in {b} hours. {ab} + {c} = {r} km."),
]


def _math(rng, seen, n):
  out = []
  while len(out) < n:
    k = rng.randrange(len(_MATH))
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 15)
    key = (k, a, b, c)
    if key in seen:
      continue
    seen.add(key)
    template, fn, reasoning = _MATH[k]
    r = fn(a, b, c)
    ab, p = a * b, a * b + c
    prompt = template.format(a=a, b=b, c=c, p=p)
    sol = reasoning.format(a=a, b=b, c=c, ab=ab, r=r, p=p)
    out.append({"prompt": prompt, "answer": r, "solution": f"{sol}\n#### {r}"})
  # Fractions: the answer in LaTeX, matched by value (0.5 == \frac{1}{2}).
  for _ in range(max(1, n // 8)):
    a, b = rng.randint(1, 4), rng.randint(5, 9)
    if ("frac", a, b) in seen:
      continue
    seen.add(("frac", a, b))
    out.append({"prompt": f"A cake is cut into {b} equal slices and {a} are eaten. What "
                          "fraction of the cake is eaten?",
                "answer": f"\\frac{{{a}}}{{{b}}}",
                "solution": f"{a} of {b} slices: \\boxed{{\\frac{{{a}}}{{{b}}}}}"})
  return out


def _mbpp(rng, seen, n):
  out = []
  kinds = ["add", "mul", "rev", "count", "stack"]
  while len(out) < n:
    kind, k = rng.choice(kinds), rng.randint(2, 40)
    if (kind, k) in seen:
      continue
    seen.add((kind, k))
    name = f"{kind}_{k}"
    if kind == "add":
      prompt = f"Write a function {name}(x) that returns x plus {k}."
      code = f"def {name}(x):\n    return x + {k}"
      tests = [f"assert {name}({x}) == {x + k}" for x in (0, 3, -5)]
    elif kind == "mul":
      prompt = f"Write a function {name}(xs) that returns the list xs with every item times {k}."
      code = f"def {name}(xs):\n    return [x * {k} for x in xs]"
      tests = [f"assert {name}({xs}) == {[x * k for x in xs]}" for xs in ([1, 2], [], [-3])]
    elif kind == "rev":
      prompt = (f"Write a function {name}(s) that returns the string s reversed, followed by "
                f"the number {k}.")
      code = f"def {name}(s):\n    return s[::-1] + str({k})"
      tests = [f"assert {name}({s!r}) == {s[::-1] + str(k)!r}" for s in ("ab", "", "xyz")]
    elif kind == "count":
      prompt = (f"Write a function {name}(xs) that counts the items of xs greater than {k}, "
                "using collections.Counter.")
      code = (f"import collections\n\ndef {name}(xs):\n"
              f"    c = collections.Counter(x > {k} for x in xs)\n    return c[True]")
      tests = [f"assert {name}({xs}) == {sum(x > k for x in xs)}"
               for xs in ([k + 1, k, 0], [], [k + 5, k + 6])]
    else:
      prompt = (f"Write a function {name}(ops) that runs push/pop ops (a list of ints, -1 = "
                f"pop) on a stack class and returns the final stack plus {k} on top.")
      code = (f"class Stack:\n    def __init__(self):\n        self.items = []\n\n"
              f"def {name}(ops):\n    s = Stack()\n    for op in ops:\n"
              f"        if op == -1:\n            s.items.pop()\n        else:\n"
              f"            s.items.append(op)\n    return s.items + [{k}]")
      cases = ([1, 2, -1], [], [5])
      want = {(1, 2, -1): [1, k], (): [k], (5,): [5, k]}
      tests = [f"assert {name}({c}) == {want[tuple(c)]}" for c in cases]
    out.append({"prompt": prompt, "tests": tests, "canonical_solution": code})
  return out


def _humaneval(rng, seen, n):
  out = []
  while len(out) < n:
    k = rng.randint(2, 30)
    if ("he", k) in seen:
      continue
    seen.add(("he", k))
    name = f"shift_{k}"
    prompt = (f"def {name}(xs: list) -> list:\n    \"\"\"Return xs with {k} added to every "
              "item, sorted.\"\"\"\n")
    out.append({"prompt": prompt, "entry_point": name,
                "canonical_solution": f"    return sorted(x + {k} for x in xs)\n",
                "test": ("def check(candidate):\n"
                         f"    assert candidate([3, 1]) == [{1 + k}, {3 + k}]\n"
                         "    assert candidate([]) == []\n")})
  return out


_PLACES = ["Oskel", "Varn", "Tirra", "Melk", "Quorra", "Dusk", "Pellin", "Arbo", "Zenna",
           "Hollow", "Brisk", "Cairn", "Lume", "Fenner", "Gask", "Ivel"]


def _call(name, **arguments):
  return ("<tool_call>" + json.dumps({"name": name, "arguments": arguments}) +
          "</tool_call>")


def _obs(text):
  return f"<tool_response>{text}</tool_response>"


def _tool(rng, seen, n):
  out = []
  while len(out) < n:
    a, b = rng.sample(_PLACES, 2)
    single = rng.random() < 0.5
    key = ("len", a) if single else ("sum", frozenset((a, b)))  # the underlying problem
    if key in seen:
      continue
    seen.add(key)
    la, lb = rng.randint(50, 900), rng.randint(50, 900)
    docs = {f"River {a}": f"The river {a} is {la} km long.",
            f"River {b}": f"The river {b} is {lb} km long.",
            f"Town {a}": f"{a} is a market town with {rng.randint(2, 90)} thousand people."}
    if single:
      prompt = f"How long is the river {a}, in km? Use the tools."
      answer = la
      sol = (_call("search", query=f"river {a}") + _obs(json.dumps([f"River {a}"])) +
             _call("lookup", title=f"River {a}") + _obs(docs[f"River {a}"]) +
             f"The river {a} is {la} km long.\n#### {la}")
    else:
      prompt = (f"What is the total length of the rivers {a} and {b}, in km? Use the tools.")
      answer = la + lb
      sol = (_call("lookup", title=f"River {a}") + _obs(docs[f"River {a}"]) +
             _call("lookup", title=f"River {b}") + _obs(docs[f"River {b}"]) +
             _call("calculator", expression=f"{la} + {lb}") + _obs(repr(la + lb)) +
             f"Together they are {la + lb} km long.\n#### {la + lb}")
    out.append({"prompt": prompt, "answer": answer, "solution": sol,
                "tools": {"documents": docs, "calculator": True}})
  return out


def _write_jsonl(name, rows):
  with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")


def main():
  rng = random.Random(0)
  seen = set()
  _write_jsonl("math_train.jsonl", _math(rng, seen, 40))
  _write_jsonl("math_test.jsonl", _math(rng, seen, 12))
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  train = _mbpp(rng, seen, 32)
  pq.write_table(pa.Table.from_pylist(train), os.path.join(HERE, "code.parquet"))
  _write_jsonl("code_test.jsonl", _mbpp(rng, seen, 6) + _humaneval(rng, seen, 4))
  _write_jsonl("tool_train.jsonl", _tool(rng, seen, 36))
  _write_jsonl("tool_test.jsonl", _tool(rng, seen, 10))
  with open(os.path.join(HERE, "spec.json"), "w", encoding="utf-8") as f:
    json.dump({"domains": {
        "math": {"verifier": "math", "train": "math_train.jsonl", "test": "math_test.jsonl",
                 "validation": 4},
        "code": {"verifier": "python_tests", "train": "code.parquet",
                 "test": "code_test.jsonl", "validation": 3},
        "tool": {"verifier": "tool", "train": "tool_train.jsonl", "test": "tool_test.jsonl",
                 "validation": 3}},
        "efforts": {"low": 0.5, "max": 1.0}, "budget": {"source": "reference"}}, f, indent=1)
    f.write("\n")


if __name__ == "__main__":
  main()
