"""MOPD on your own data: domains of JSONL / Parquet record files, named by a spec file.

Run:
    python -m experiments.run --config configs/files.py:SPEC.json --workdir DIR \
        --config.model.hf_path=/ckpt/Qwen3-0.6B \
        --config.model.tokenizer_path=/ckpt/Qwen3-0.6B/tokenizer.json

SPEC.json (paths relative to the spec file, or absolute, or `gs://...`; the spec itself may be
on object storage too: `--config configs/files.py:gs://bucket/data/spec.json`;
`examples/spec.json` is a small runnable one):

    {"domains": {"math": {"verifier": "math", "train": "math_train.jsonl",
                          "test": "math_test.jsonl"},
                 "code": {"verifier": "python_tests", "train": "code.parquet",
                          "test": "code_test.jsonl", "validation": 16}},
     "efforts": {"low": 0.3, "max": 1.0},
     "budget": {"source": "reference"}}

Each domain runs the `records` task (mopd_jax/tasks/records.py) with the named verifier
(mopd_jax/tasks/verifiers.py: math, python_tests, exact); `validation` training records are
held out for the RL lanes' validation (default 8, at most a tenth of train). `efforts` maps
each effort to its tau (budget = floor(tau * b0)). `budget.source`: reference | field.
Every other setting is a config field of configs/base.py, set on the command line.

Defaults for a chat model of any family: prompts rendered by the tokenizer's chat template,
the student's effort as a text line ("Reasoning effort: high": no token is added to the
vocabulary), a system message where the template has a system role and the start of the
user's turn where it has none (`prompt.effort_format=auto`); the end of a response, padding
and BOS read from the tokenizer's own files (the `prompt.*_token` fields override them); tool
markers only for a domain with the `tool` verifier (the tokenizer's `<tool_call>` ... when it
has them, else added); teachers see no effort (K3 eq. 15); and `sft.steps=0`: the loaded
checkpoint is pi_SFT as it is (set `--config.sft.steps=N` to train it on the records'
reference responses first).

Teachers brought as checkpoints, of any family: `--config.teacher.hf_paths=math/low=DIR,...`,
with `--config.teacher.tokenizer_path=TOKENIZER.json` when they read another tokenizer than
the student's, or `--config.teacher.tokenizer_paths=math/low=TOKENIZER.json,...` for the cells
whose teachers read yet another (teachers of several families, a bank each;
docs/cross_tokenizer.md).
"""
import json
import os

import ml_collections

from configs import base
from mopd_jax.io import storage

_SPEC_KEYS = ("domains", "efforts", "budget")
_DOMAIN_KEYS = ("verifier", "train", "test", "validation")


def _spec_error(path: str, what: str) -> ValueError:
  return ValueError(f"{path}: {what}")


def read_spec(path: str) -> dict:
  """The spec file as a dict, checked: its keys, each domain's keys, each effort's tau."""
  try:
    spec = json.loads(storage.read_text(path))
  except OSError as e:
    raise _spec_error(path, f"cannot read the spec file ({e.strerror or e})") from None
  except ValueError as e:
    raise _spec_error(path, f"not valid JSON ({e})") from None
  if not isinstance(spec, dict):
    raise _spec_error(path, "the spec must be a JSON object")
  unknown = sorted(set(spec) - set(_SPEC_KEYS))
  if unknown:
    raise _spec_error(path, f"unknown key(s) {unknown}; a spec has {list(_SPEC_KEYS)}")
  domains, efforts = spec.get("domains"), spec.get("efforts")
  if not isinstance(domains, dict) or not domains:
    raise _spec_error(path, "'domains' must map each domain name to its files and verifier")
  if not isinstance(efforts, dict) or not efforts:
    raise _spec_error(path, "'efforts' must map each effort name to its tau")
  for d, block in domains.items():
    if not isinstance(block, dict):
      raise _spec_error(path, f"domain {d!r} must be an object")
    bad = sorted(set(block) - set(_DOMAIN_KEYS))
    if bad:
      raise _spec_error(path, f"domain {d!r} has unknown key(s) {bad}; known: "
                        f"{list(_DOMAIN_KEYS)}")
    for key in ("verifier", "train", "test"):
      if not isinstance(block.get(key), str) or not block[key]:
        raise _spec_error(path, f"domain {d!r} needs {key!r} (a string)")
  for e, tau in efforts.items():
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
      raise _spec_error(path, f"effort {e!r}: tau must be a positive number, got {tau!r}")
  return spec


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: the path of the spec file."""
  if not arg:
    raise ValueError("configs/files.py needs a spec file: --config configs/files.py:SPEC.json")
  spec = read_spec(arg)
  folder = storage.path(arg).parent
  where = lambda p: p if storage.is_remote(p) or os.path.isabs(p) else storage.join(folder, p)
  c = base.get_config()
  c.domains = ",".join(spec["domains"])
  c.efforts = ",".join(spec["efforts"])
  c.tasks = ml_collections.ConfigDict({
      d: {"task": "records", "verifier": b["verifier"],
          "train": where(b["train"]), "test": where(b["test"]),
          "validation": int(b.get("validation", 8))}
      for d, b in spec["domains"].items()})
  c.effort = ml_collections.ConfigDict({e: {"tau": float(t)}
                                        for e, t in spec["efforts"].items()})
  c.budget.source = (spec.get("budget") or {}).get("source", "reference")

  c.model.preset = "qwen3-0.6b"  # shapes come from model.hf_path's config.json when given
  c.prompt.effort_format = "auto"
  c.teacher.effort_in_prompt = False
  c.sft.steps = 0
  c.sft.schedule = ""
  c.rollout.max_response_tokens = 1024
  c.rollout.width = 256
  c.checkpoint.every = 5
  return c
