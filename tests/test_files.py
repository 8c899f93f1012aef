"""MOPD on record files end to end (configs/files.py): the shipped examples/ data, a tiny
Qwen3-architecture checkpoint in Hugging Face format and a BPE tokenizer in the layout of a
model family (tests/chat_families.py: its special tokens, files and chat template), both made
here. Every stage runs on CPU with no prompt flag set: data from JSONL and Parquet, SFT on the
reference responses, RL lanes with the math, python_tests (the code in the OS sandbox) and
tool verifiers (multi-turn tool calls run by the environment), effort-free teachers, MOPD,
eval and the report with every cell. Gemma's layout runs in the default tier (a template that
raises on a system message, no tool tokens); Qwen3's, Llama 3's and Mistral's in the slow
one. A tokenizer the run cannot use stops before any stage with one line and exit status 2."""
import json
import os
import subprocess
import sys

import chat_families
import jax

from mopd_jax import configure
import numpy as np
import pytest
import suite_cli

ROOT = suite_cli.ROOT
EXAMPLES = os.path.join(ROOT, "examples")


def make_chat_checkpoint(folder, family: str = "gemma", vocab_extra: int = 0,
                         preset: str = "qwen3-0.6b") -> str:
  """The tokenizer folder of `family` (its BPE trained on the example records) and a random
  tiny checkpoint of `preset`'s family (Qwen3 by default) whose embedding has a row per token
  of tokenizer.json (no spare rows: tokens the run adds grow it), all in `folder`; returns
  `folder`."""
  tokenizers = pytest.importorskip("tokenizers")
  from mopd_jax import models
  from mopd_jax.io import hf
  import configs.qwen3_mopd as q
  texts = []
  for name in os.listdir(EXAMPLES):
    if name.endswith(".jsonl"):
      texts += open(os.path.join(EXAMPLES, name), encoding="utf-8").read().splitlines()
  chat_families.make_family(family, folder, texts * 3, vocab_size=600)
  vocab = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
  shape = dict(q._TINY_SHAPE)  # pylint: disable=protected-access
  if preset != "qwen3-0.6b":  # a Llama 3 layout: no QK-norm
    shape.update(qk_norm=False)
  cfg = models.get_preset(preset, **shape, vocab_size=vocab.get_vocab_size() + vocab_extra)
  hf.save_checkpoint(cfg, jax.device_get(models.init_params(cfg, jax.random.PRNGKey(0))),
                     folder)
  return folder


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
  return make_chat_checkpoint(str(tmp_path_factory.mktemp("chat") / "ckpt"))


def _run(spec, wd, ckpt, *flags, timeout=600):
  return subprocess.run(
      [sys.executable, "-m", "experiments.run", "--config",
       os.path.join("configs", "files.py") + ":" + spec, "--workdir", str(wd),
       f"--config.model.hf_path={ckpt}", f"--config.model.tokenizer_path={ckpt}/tokenizer.json",
       *flags], cwd=ROOT, env=suite_cli.env(), capture_output=True, text=True, timeout=timeout)


SMALL = ("--config.sft.steps=2", "--config.sft.batch_size=4",
         "--config.rl.steps_per_effort=1", "--config.rl.prompts_per_step=2",
         "--config.rl.group_size=2", "--config.mopd.steps=2", "--config.mopd.prompts_per_cell=1",
         "--config.eval.num_examples=2", "--config.rollout.max_response_tokens=16",
         "--config.rollout.width=64", "--config.checkpoint.every=1",
         "--config.data.max_prompt_tokens=120")


@pytest.mark.parametrize("family", [
    "gemma", *(pytest.param(f, marks=pytest.mark.slow) for f in ("qwen3", "llama3", "mistral"))])
def test_every_stage_on_the_example_records(tmp_path, chat_ckpt, family):
  ckpt = chat_ckpt if family == "gemma" else make_chat_checkpoint(str(tmp_path / "ckpt"),
                                                                  family)
  wd = tmp_path / "wd"
  proc = _run(os.path.join(EXAMPLES, "spec.json"), wd, ckpt, *SMALL)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  done = json.load(open(wd / "data" / "DONE.json"))
  counts = done["records"]
  assert set(counts) == {"math", "code", "tool"}
  assert counts["math"]["validation"]["kept"] == 4 and counts["code"]["validation"]["kept"] == 3
  assert counts["math"]["train"]["kept"] + counts["math"]["train"]["too_long"] == 41
  rep = json.load(open(wd / "report.json"))
  cells = {(c["policy"], c["domain"], c["effort"]) for c in rep["cells"]}
  assert cells == {(p, d, e) for p in ("sft", "teacher", "student")
                   for d in ("math", "code", "tool") for e in ("low", "max")}
  assert all(c["n"] == 2 for c in rep["cells"])
  md = open(wd / "report.md").read()
  assert "Base budgets b0" in md and "| math |" in md
  manifest = json.load(open(wd / "teachers.json"))
  assert sorted(manifest["teachers"]) == ["code/low", "code/max", "math/low", "math/max",
                                          "tool/low", "tool/max"]
  assert json.load(open(wd / "sft" / "DONE.json"))["steps"] == 2


def test_a_llama_3_teacher_for_a_qwen3_student(tmp_path):
  """Two families: a Qwen3-layout student with its tokenizer and template, Llama-3-layout
  teachers with theirs (`teacher.tokenizer_path`), every stage on the example records: the
  teachers score the student's responses re-encoded in their tokens after their own
  template's prompt, and every cell of the report is filled."""
  student = make_chat_checkpoint(str(tmp_path / "qwen3"), "qwen3")
  teacher = make_chat_checkpoint(str(tmp_path / "llama3"), "llama3", preset="llama-3.2-1b")
  wd = tmp_path / "wd"
  cells = [f"{d}/{e}" for d in ("math", "code", "tool") for e in ("low", "max")]
  proc = _run(os.path.join(EXAMPLES, "spec.json"), wd, student, *SMALL,
              "--config.teacher.hf_paths=" + ",".join(f"{c}={teacher}" for c in cells),
              f"--config.teacher.tokenizer_path={teacher}/tokenizer.json")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  manifest = json.load(open(wd / "teachers.json"))
  assert all(t["tokenizer"]["other"] for t in manifest["teachers"].values())
  rep = json.load(open(wd / "report.json"))
  assert {(c["policy"], c["domain"], c["effort"]) for c in rep["cells"]} == {
      (p, d, e) for p in ("sft", "teacher", "student") for d in ("math", "code", "tool")
      for e in ("low", "max")}
  history = json.load(open(wd / "mopd" / "history.json"))
  assert sorted(history[-1]["cells"]) == sorted(cells)
  assert all(np.isfinite(c["kl"]) for h in history for c in h["cells"].values())
  assert sum(h["unaligned_rows"] for h in history) < len(history) * len(cells)


@pytest.mark.slow
def test_teachers_of_two_families_for_a_qwen3_student(tmp_path):
  """Two teacher families in one run (`teacher.tokenizer_paths`): Llama-3-layout teachers
  with their own tokenizer for the math cells, Qwen3-layout teachers of the student's
  tokenizer for the code and tool cells; every stage on the example records, each cell
  scored by its own family's bank and the report's origins counted apart."""
  student = make_chat_checkpoint(str(tmp_path / "qwen3"), "qwen3")
  llama = make_chat_checkpoint(str(tmp_path / "llama3"), "llama3", preset="llama-3.2-1b")
  wd = tmp_path / "wd"
  cells = [f"{d}/{e}" for d in ("math", "code", "tool") for e in ("low", "max")]
  of = {c: llama if c.startswith("math/") else student for c in cells}
  proc = _run(os.path.join(EXAMPLES, "spec.json"), wd, student, *SMALL,
              "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in of.items()),
              "--config.teacher.tokenizer_paths=" + ",".join(
                  f"{c}={llama}/tokenizer.json" for c in cells if of[c] == llama))
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert "2 teacher families" in proc.stdout
  manifest = json.load(open(wd / "teachers.json"))
  assert {c for c, t in manifest["teachers"].items() if t["tokenizer"]["other"]} == {
      "math/low", "math/max"}
  rep = json.load(open(wd / "report.json"))
  assert {(c["policy"], c["domain"], c["effort"]) for c in rep["cells"]} == {
      (p, d, e) for p in ("sft", "teacher", "student") for d in ("math", "code", "tool")
      for e in ("low", "max")}
  assert set(rep["kl"]["initial_by_origin"]) == {"other tokenizer", "same"}
  history = json.load(open(wd / "mopd" / "history.json"))
  assert sorted(history[-1]["cells"]) == sorted(cells)
  assert all(np.isfinite(c["kl"]) for h in history for c in h["cells"].values())


def test_a_tokenizer_the_run_cannot_use_is_one_line_and_exit_status_2(tmp_path, chat_ckpt):
  """A chat template whose assistant turn ends with no special token: the run stops before
  any stage with one `config error:` line naming the template's file."""
  import shutil
  ckpt = str(tmp_path / "ckpt")
  shutil.copytree(chat_ckpt, ckpt)
  cfg = json.load(open(os.path.join(ckpt, "tokenizer_config.json")))
  cfg["chat_template"] = cfg["chat_template"].replace("<end_of_turn>", "")
  json.dump(cfg, open(os.path.join(ckpt, "tokenizer_config.json"), "w"))
  proc = _run(os.path.join(EXAMPLES, "spec.json"), tmp_path / "wd", ckpt, timeout=300)
  lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("config error:")]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
  assert f"{ckpt}/tokenizer_config.json: the chat template ends an assistant turn" in lines[0]
  assert "no end-of-turn token" in lines[0] and not os.path.exists(tmp_path / "wd" / "data")


def test_measured_budgets_replace_the_placeholders(tmp_path, chat_ckpt):
  """budget.source=samples: the data stage's b0s are placeholders; once the rl stage has
  stored measured ones, every split read through the run has them, examples without one
  (no correct sample) are left out, and grain batches come from the rest."""
  import configs.files as files
  from mopd_jax.io import checkpoint
  from mopd_jax.stages import context, wiring
  c = files.get_config(os.path.join(EXAMPLES, "spec.json"))
  c.model.hf_path, c.model.tokenizer_path = chat_ckpt, chat_ckpt + "/tokenizer.json"
  c.budget.source = "samples"
  c.mesh.data = 8  # the suite's 8 simulated devices
  ctx = context.Run(configure.build(c, jax.device_count()), str(tmp_path / "wd"))
  wiring.STAGES["data"](ctx)
  train = ctx.data.split("math", "train")
  assert {train[i].b0 for i in range(len(train))} == {1}  # placeholders
  uids = [train[i].uid for i in range(len(train))]
  measured = {u: (None if i % 3 == 0 else 10 + i) for i, u in enumerate(uids)}
  checkpoint.write_json(ctx.data.budgets_path("math"),
                        {"b0": measured, "k": 2, "counts": {"measured": 1}})
  got = ctx.data.split("math", "train")
  assert len(got) == sum(v is not None for v in measured.values())
  assert all(got[i].b0 == measured[got[i].uid] for i in range(len(got)))
  batch = next(ctx.data.iterator("math", 4, salt=0))
  assert len(batch) == 4 and all(measured[e.uid] == e.b0 for e in batch)
  assert ctx.data.split("code", "train")[0].b0 == 1  # not measured yet


def test_data_stage_reads_a_spec_on_object_storage(tmp_path, chat_ckpt, gcs):
  """The examples spec and its files on gs:// (conftest.py's stand-in bucket): the data
  stage keeps, drops and deduplicates exactly what it does with the same files read
  locally."""
  import shutil
  import configs.files as files
  from mopd_jax.stages import context, wiring
  shutil.copytree(EXAMPLES, os.path.join(gcs, "bucket", "ex"))
  done = {}
  for where, spec in (("local", os.path.join(EXAMPLES, "spec.json")),
                      ("gs", "gs://bucket/ex/spec.json")):
    c = files.get_config(spec)
    c.model.hf_path, c.model.tokenizer_path = chat_ckpt, chat_ckpt + "/tokenizer.json"
    c.mesh.data = 8  # the suite's 8 simulated devices
    ctx = context.Run(configure.build(c, jax.device_count()), str(tmp_path / where))
    assert ctx.config.records["code"].train == os.path.join(os.path.dirname(spec),
                                                            "code.parquet")
    wiring.STAGES["data"](ctx)
    done[where] = json.load(open(tmp_path / where / "data" / "DONE.json"))["records"]
    train = ctx.data.split("math", "train")
    assert train[0].meta["source"].startswith("math_train.jsonl:")
  assert done["gs"] == done["local"] and set(done["gs"]) == {"math", "code", "tool"}
  assert done["gs"]["math"]["validation"]["kept"] == 4


def test_a_spec_without_a_tool_domain_asks_for_no_tool_token(tmp_path, chat_ckpt):
  """Math and code only: the tokenizer gets no tool marker (none is added, the ids are None)
  and a rollout stops at the end of a response only."""
  import configs.files as files
  from mopd_jax.stages import context
  spec = json.load(open(os.path.join(EXAMPLES, "spec.json")))
  del spec["domains"]["tool"]
  for block in spec["domains"].values():
    for split in ("train", "test"):
      block[split] = os.path.join(EXAMPLES, block[split])
  with open(tmp_path / "spec.json", "w") as f:
    json.dump(spec, f)
  c = files.get_config(str(tmp_path / "spec.json"))
  c.model.hf_path, c.model.tokenizer_path = chat_ckpt, chat_ckpt + "/tokenizer.json"
  c.mesh.data = 8  # the suite's 8 simulated devices
  ctx = context.Run(configure.build(c, jax.device_count()), str(tmp_path / "wd"))
  tok = ctx.tok
  assert (tok.call_id, tok.call_end_id, tok.obs_id, tok.obs_end_id) == (None,) * 4
  raw = pytest.importorskip("tokenizers").Tokenizer.from_file(c.model.tokenizer_path)
  assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)  # Gemma's: nothing added
  assert ctx.engines.student.scfg.stop_tokens == (tok.eos_id,)
  assert tok.decode([tok.eos_id]) == "<end_of_turn>"
