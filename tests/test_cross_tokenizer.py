"""Teachers of another tokenizer (`teacher.tokenizer_path`): a byte-level BPE fitted on the toy
corpus (mopd_jax/io/bpe.py), teachers brought as checkpoints of its vocabulary, a student with
the character tokenizer; the run's stages, its manifest and its start-up errors."""
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import saved
import suite_cli

ROOT = suite_cli.ROOT
CELLS = tuple(f"{d}/{e}" for d in ("gen", "agt", "cod") for e in ("low", "high", "max"))


def toy_texts(n: int = 200) -> list:
  """Prompts and reference responses of the three toy tasks (tool markers included)."""
  from mopd_jax.tasks import base
  texts = []
  for name in ("gen", "agt", "cod"):
    for ex in base.get_task(name, domain=name).generate(0, n):
      texts.append(ex.prompt)
      texts.extend(ex.solutions.values())
  return texts


@pytest.fixture(scope="module")
def bpe_teachers(tmp_path_factory):
  """(tokenizer.json, {cell: checkpoint}) of nine tiny teachers of a BPE vocabulary."""
  import configs.qwen3_mopd as q
  from mopd_jax import models
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io import bpe, hf
  from mopd_jax.io.tokenizer import SPECIALS, load_tokenizer
  root = tmp_path_factory.mktemp("bpe")
  path = bpe.fit(toy_texts(), str(root / "tok"), vocab_size=400, specials=SPECIALS)
  tok = load_tokenizer(path, options=TokenizerOptions(chat=False))
  tcfg = hf.resolve_model_config(q.get_config("tiny").teacher, tok.vocab_size)
  paths = {}
  for i, cell in enumerate(CELLS):
    paths[cell] = str(root / f"t{i}")
    hf.save_checkpoint(tcfg, jax.device_get(models.init_params(tcfg, jax.random.PRNGKey(i))),
                       paths[cell])
  return path, paths


def test_bpe_fit_writes_multi_character_tokens_and_the_toy_specials(bpe_teachers):
  """The fitted BPE keeps the toy's specials whole and writes most of the toy's text in
  multi-character tokens; every text round-trips."""
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io import bpe
  from mopd_jax.io.tokenizer import SPECIALS, load_tokenizer
  tok = load_tokenizer(bpe_teachers[0], options=TokenizerOptions(chat=False))
  texts = toy_texts(50)
  assert bpe.multi_char_share(tok, texts) >= 0.3
  for t in texts[:40]:
    assert tok.decode(tok.encode(t)) == t
  assert tok.encode("<call>") == [tok.call_id] and tok.encode("<obs>") == [tok.obs_id]
  with pytest.raises(ValueError, match="leaves no merges"):
    bpe.fit(texts, bpe_teachers[0] + ".x.json", vocab_size=200)
  apart = load_tokenizer(bpe.fit(texts, bpe_teachers[0] + ".d.json", vocab_size=400,
                                 specials=SPECIALS, digits_apart=True),
                         options=TokenizerOptions(chat=False))
  pieces = apart.token_bytes(apart.encode("2,2,0,2\n#12+30"))
  assert all(sum(c.isdigit() for c in p.decode()) <= 1 for p in pieces)
  assert b"2," in pieces and bpe.multi_char_share(apart, texts) >= 0.3


def _run(tmp_path, *flags, stages="data,sft,rl,mopd,eval,report", devices=None):
  return subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path / "wd"),
                         f"--config.stages={stages}", "--config.mopd.loss=mopd", *flags],
                        cwd=ROOT, env=suite_cli.env(devices), capture_output=True, text=True,
                        timeout=600)


def _experiment(name: str, workdir, *flags):
  """`python -m experiments.<name>` on a tiny run of `_run` with its teachers' `flags`; the
  finished process (asserted to exit 0)."""
  proc = subprocess.run([sys.executable, "-m", f"experiments.{name}", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(workdir),
                         "--config.mopd.loss=mopd", *flags], cwd=ROOT, env=suite_cli.env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_every_stage_runs_with_teachers_of_another_tokenizer(tmp_path, bpe_teachers):
  """Every stage with BPE teachers and a character-level student: the manifest records the
  teachers' tokenizer, the MOPD steps run across the tokenizers (every row aligned, each
  cell's span log-ratio finite), the eval measures the teachers in their own tokens, and a
  manifest made with another tokenizer is refused."""
  path, paths = bpe_teachers
  hf_paths = "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in paths.items())
  proc = _run(tmp_path, hf_paths, f"--config.teacher.tokenizer_path={path}",
              "--config.eval.kl_rollouts=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  manifest = json.load(open(tmp_path / "wd" / "teachers.json"))
  for entry in manifest["teachers"].values():
    assert entry["tokenizer"]["other"] and entry["tokenizer"]["path"] == path
  history = json.load(open(tmp_path / "wd" / "mopd" / "history.json"))
  for rec in history:
    assert rec["unaligned_rows"] == 0.0 and 0 < rec["teacher_multi_token_share"] < 1
    assert set(rec["cells"]) == set(CELLS)
    for cell in rec["cells"].values():
      assert cell["unaligned"] == 0.0 and np.isfinite(cell["kl"])
  cells = json.load(open(tmp_path / "wd" / "eval.json"))["cells"]
  assert {c["policy"] for c in cells} == {"sft", "student", "teacher"}
  # The held-out measure across tokenizers: the sampled sequence log-ratio per token, for
  # pi_SFT and the final student; the held-out exact-KL rows stay unmeasured.
  held = json.load(open(tmp_path / "wd" / "eval.json"))["kl_heldout"]
  assert {"sft", "student"} <= set(held)
  for h in held.values():
    assert h["measure"] == "sampled" and np.isfinite(h["kl_exact"]) and h["rollouts"] > 0
  report = json.load(open(tmp_path / "wd" / "report.json"))
  assert set(report["kl"]["initial_by_origin"]) == {"other tokenizer"}
  assert "Sampled sequence log-ratio per token (teachers of another tokenizer) to the " \
      "routed teachers on held-out prompts" in open(tmp_path / "wd" / "report.md").read()
  exact_rows = [c for c in report["checks"] if c["name"].startswith("held-out exact KL")]
  assert exact_rows and all(c["ok"] is None and c["value"] is None for c in exact_rows)
  # `experiments.kl_tail` ranks the same rollouts by the same measure: its mean is the eval's.
  run_on = lambda name, *args: _experiment(name, tmp_path / "wd", hf_paths,
                                           f"--config.teacher.tokenizer_path={path}", *args)
  tail = run_on("kl_tail", "--prompts=2", "--top=1")
  assert (f"sampled sequence log-ratio per token (teachers of another tokenizer) over "
          f"{held['student']['rollouts']} rollouts: {held['student']['kl_exact']:.4f}"
          ) in tail.stdout, tail.stdout
  assert "`other tokenizer` = a teacher of another tokenizer" in open(
      tmp_path / "wd" / "report.md").read()
  # `experiments.greedy_parts` on a teacher of another tokenizer: the greedy accuracies are
  # the eval's on its 16 prompts (the teacher in its own tokens), the parting positions are
  # the student's characters, the teacher's margin is by characters; the tiny teachers'
  # responses the character tokenizer cannot write (bytes of no character) are counted.
  parts = tmp_path / "parts.json"
  run_on("greedy_parts", "--cell=gen/high", "--examples=16", f"--out={parts}")
  g = json.load(open(parts))
  for policy in ("student", "teacher"):
    (acc,) = [c["accuracy"] for c in cells
              if (c["policy"], c["domain"], c["effort"]) == (policy, "gen", "high")]
    assert g["accuracy"][policy] == acc
  assert g["teacher_margin_by"] == "char" and 0 < g["parted"] <= 16 - g["teacher_unwritable"]
  assert sum(g["positions"].values()) == g["parted"]
  assert g["margin_quantiles"]["student"][0] >= -1e-4
  assert np.all(np.isfinite(g["margin_quantiles"]["teacher"]))
  # `experiments.memo_probe`: pi_SFT and the final student, and the teacher of gen/high by
  # characters, each with its mass on the three values after `~` (a policy the run does not
  # hold is skipped).
  probe = tmp_path / "probe.json"
  proc = run_on("memo_probe", "--examples=16", "--params=sft/params,mopd/params,mopd/nothing",
                f"--out={probe}")
  got = json.load(open(probe))["policies"]
  assert set(got) == {"sft/params", "mopd/params", "teacher"}
  assert "mopd/nothing: not in the run, skipped" in proc.stdout
  for split in got.values():
    assert sum(g["prompts"] for g in split.values()) == 16
  # The char_kl loss on the same run: every generated token of every row gets the teachers'
  # next-character distribution, the partial tokens' branches are scored.
  (tmp_path / "char").mkdir()
  shutil.copytree(tmp_path / "wd", tmp_path / "char" / "wd",
                  ignore=shutil.ignore_patterns("mopd", "eval*", "report*"))
  proc = _run(tmp_path / "char", hf_paths, f"--config.teacher.tokenizer_path={path}",
              "--config.mopd.loss=char_kl", stages="mopd")
  assert proc.returncode == 0, proc.stderr[-3000:]
  mopd_rows = json.load(open(tmp_path / "char" / "wd" / "mopd" / "history.json"))
  for rec in mopd_rows:
    assert rec["char_positions"] > 0 and rec["char_branches"] > 0
    assert rec["char_kl"] > 0 and np.isfinite(rec["char_kl"])
    assert rec["unaligned_rows"] == 0.0
  # Resumed from its checkpoint of step 2, the run's last step and final params are the
  # uninterrupted run's, bitwise (the targets hold no state of their own).
  mopd_dir = tmp_path / "char" / "wd" / "mopd"
  final = saved.arrays(mopd_dir / "params")
  for name in ("DONE.json", "history.json"):
    (mopd_dir / name).unlink()
  shutil.rmtree(mopd_dir / "params")
  shutil.rmtree(mopd_dir / "ckpt" / str(len(mopd_rows)))
  proc = _run(tmp_path / "char", hf_paths, f"--config.teacher.tokenizer_path={path}",
              "--config.mopd.loss=char_kl", stages="mopd")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"resuming from checkpoint step {len(mopd_rows) - 1}" in proc.stdout + proc.stderr
  untimed = lambda rows: [{k: v for k, v in r.items() if k != "char_seconds"} for r in rows]
  assert untimed(json.load(open(mopd_dir / "history.json"))) == untimed(mopd_rows)
  again = saved.arrays(mopd_dir / "params")
  assert again.keys() == final.keys() and final
  assert all(np.array_equal(again[k], final[k]) for k in final)
  # The same teachers read as if they had the student's tokenizer: refused.
  shutil.rmtree(tmp_path / "wd" / "mopd")
  proc = _run(tmp_path, hf_paths, stages="mopd")
  assert proc.returncode != 0
  assert "teacher vocabulary size 400 differs from the student's" in proc.stderr
  # A manifest whose teachers were recorded with another tokenizer than the run's: refused.
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.teachers import bank
  from mopd_jax.tasks import grid as grid_mod
  manifest = json.load(open(tmp_path / "wd" / "teachers.json"))
  grid = grid_mod.Grid.from_json(manifest["grid"])
  record = dict(manifest["teachers"]["gen/low"]["tokenizer"], fingerprint="0" * 16)
  with pytest.raises(ValueError, match="recorded with tokenizer"):
    bank.validate_manifest(manifest, "teachers.json", grid, student_cfg=models.get_preset(
                               "toy", vocab_size=CharTokenizer().vocab_size),
                           resolve_hf=lambda p: None, tokenizer=record)


def test_a_missing_teacher_tokenizer_is_one_config_error(tmp_path, bpe_teachers):
  _, paths = bpe_teachers
  proc = _run(tmp_path, "--config.teacher.hf_paths=" + ",".join(f"{c}={p}"
                                                                for c, p in paths.items()),
              f"--config.teacher.tokenizer_path={tmp_path}/none.json", stages="data")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert f"config error: teacher.tokenizer_path='{tmp_path}/none.json'" in proc.stderr
  broken = tmp_path / "broken.json"
  broken.write_text("{not json")
  proc = _run(tmp_path, "--config.teacher.hf_paths=" + ",".join(f"{c}={p}"
                                                                for c, p in paths.items()),
              f"--config.teacher.tokenizer_path={broken}", stages="data")
  assert proc.returncode == 2 and "cannot load tokenizer" in proc.stderr


def test_the_teacher_sft_init_learns_the_teachers_responses_in_the_students_tokens(
    bpe_teachers):
  """`teacher_pool` with a teacher of another tokenizer: each in-budget teacher trajectory
  (a tool call, its observation, the answer, in BPE tokens) becomes the student's tokens
  after the student's prompt, observations still masked; one the student's tokenizer
  cannot write is left out."""
  import types
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io.tokenizer import CharTokenizer, load_tokenizer
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.stages import mopd_init as stage
  from mopd_jax.tasks import base, views
  student = CharTokenizer()
  teacher = load_tokenizer(bpe_teachers[0], options=TokenizerOptions(chat=False))
  exs = base.get_task("agt", domain="agt").generate(3, 2)
  call = [teacher.call_id] + teacher.encode("boss(ann)") + [teacher.call_end_id]
  obs = [teacher.obs_id] + teacher.encode("bob") + [teacher.obs_end_id]
  tail = teacher.encode("\n#bob") + [teacher.eos_id]
  good = call + obs + tail
  bad = teacher.encode("#b\u00e9b") + [teacher.eos_id]  # a character the student lacks

  class Engine:
    def run(self, params, examples, efforts, **kw):
      del params, kw
      assert efforts == [None] * len(examples)  # the teachers' effort-free view
      trajs = [rollout.Trajectory(teacher.encode_prompt(ex.prompt, None), ids,
                                  [0 if len(call) <= i < len(call) + len(obs) else 1
                                   for i in range(len(ids))], [0.0] * len(ids), True)
               for ex, ids in zip(examples, (good, bad))]
      return rollout.RolloutResult(trajs, [""] * 2, np.zeros(2, bool))

  class Data:
    def iterator(self, domain, n, salt):
      return iter([exs])

  inp = types.SimpleNamespace(
      bank=types.SimpleNamespace(router=types.SimpleNamespace(names=("agt/high",)),
                                 params={"w": np.zeros((1, 2))}),
      data=Data(), teacher_engine=Engine(), view=views.K3, tok=student, teacher_tok=teacher,
      cross=True, cfg=types.SimpleNamespace(init_samples_per_cell=2), seed=0,
      tasks={"agt": types.SimpleNamespace(environment=None)},
      budgets=lambda examples, e: [64] * len(examples))
  pool, _ = stage.teacher_pool(inp)
  assert len(pool) == 1  # the response with a character the student lacks is left out
  t = pool[0]
  assert t.prompt_ids == student.encode_prompt(exs[0].prompt, "high")
  assert student.decode(t.ids) == "<call>boss(ann)</call><obs>bob</obs>\n#bob<eos>"
  n_call = len(student.encode("boss(ann)")) + 2
  assert t.gen_mask == [1] * n_call + [0] * 5 + [1] * 6


def test_teacher_servers_of_another_tokenizer(tmp_path, bpe_teachers):
  """`teacher.endpoints` with `teacher.tokenizer_path`: our server holding the BPE teachers
  (its own tokenizer, the run's scoring temperature) passes the start-up checks against the
  teachers' tokenizer and vocabulary and the parity probe against the run's own copies of
  them, and the MOPD steps score the student's rollouts, moved into the teachers' tokens,
  through it; a server of the student's tokenizer is refused, naming both fingerprints."""
  import configs.qwen3_mopd as q
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io import hf, tokenizer
  from mopd_jax.io.tokenizer import CharTokenizer, load_tokenizer
  from mopd_jax.teachers import bank as teachers, server as serve
  path, paths = bpe_teachers
  c = q.get_config("tiny")
  tok = load_tokenizer(path, efforts=("low", "high", "max"),
                       options=TokenizerOptions(chat=False))
  tcfg = hf.resolve_model_config(c.teacher, tok.vocab_size, hf_path=paths[CELLS[0]])
  plist = [hf.load_checkpoint(paths[cell], vocab_size=tcfg.vocab_size)[1] for cell in CELLS]
  bank = teachers.build_bank(tcfg, plist, names=CELLS)
  temperature = c.mopd.teacher_temperature
  good = serve.TeacherServer(bank, tok, temperature=temperature)
  student_tok = CharTokenizer()
  wrong = serve.TeacherServer(bank, student_tok, temperature=temperature)
  hf_paths = "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in paths.items())
  try:
    good_url = url = good.start()
    proc = _run(tmp_path, hf_paths, f"--config.teacher.tokenizer_path={path}",
                "--config.teacher.endpoints=" + ",".join(f"{c}={url}" for c in CELLS),
                stages="data,sft,rl,mopd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parity probe against the run's own teachers" in proc.stdout
    history = json.load(open(tmp_path / "wd" / "mopd" / "history.json"))
    assert all(rec["unaligned_rows"] == 0.0 and np.isfinite(rec["kl"]) for rec in history)
    # What `python -m mopd_jax.serve --teachers` builds from that run serves the teachers'
    # own tokenizer, not the student's.
    from mopd_jax import serve as entry
    import jax
    c.mesh.data = jax.device_count()  # the suite's simulated devices
    c.mopd.prompts_per_cell = jax.device_count()
    c.mopd.loss = "mopd"
    c.teacher.hf_paths = hf_paths.split("=", 1)[1]
    c.teacher.tokenizer_path = path
    _, served_tok = entry.bank_from_config(c, teachers_path=str(tmp_path / "wd" /
                                                                "teachers.json"))
    assert tokenizer.fingerprint(served_tok) == tokenizer.fingerprint(tok)
    url = wrong.start()
    shutil.rmtree(tmp_path / "wd" / "mopd")
    proc = _run(tmp_path, hf_paths, f"--config.teacher.tokenizer_path={path}",
                "--config.teacher.endpoints=" + ",".join(f"{c}={url}" for c in CELLS),
                stages="mopd")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"has tokenizer fingerprint {tokenizer.fingerprint(student_tok)} but the "
            f"run's teachers' is {tokenizer.fingerprint(tok)}") in proc.stderr
    # char_kl through a server whose top-k stops below teacher.served_top_k: refused at
    # start in one line.
    proc = _run(tmp_path, hf_paths, f"--config.teacher.tokenizer_path={path}",
                "--config.teacher.endpoints=" + ",".join(f"{c}={good_url}" for c in CELLS),
                "--config.mopd.loss=char_kl", "--config.teacher.served_top_k=21",
                stages="mopd")
    assert proc.returncode == 2 and "config error:" in proc.stderr, proc.stderr[-3000:]
    assert "max_logprobs 20" in proc.stderr, proc.stderr[-3000:]
  finally:
    good.stop()
    wrong.stop()


def test_a_response_counted_in_another_tokenizer(bpe_teachers):
  """`count_in`: a response's length in another tokenizer's tokens, each special token one
  (what `budget.count_with` and a teacher of another tokenizer are held to); the student's
  own tokenizer gives its own length."""
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io.tokenizer import CharTokenizer, load_tokenizer
  from mopd_jax.rollout import turns
  char = CharTokenizer()
  bpe = load_tokenizer(bpe_teachers[0], options=TokenizerOptions(chat=False))
  text = "<call>boss(ann)</call><obs>bob</obs>\n#bob"
  b_ids = bpe.encode(text) + [bpe.eos_id]
  c_ids = char.encode(text) + [char.eos_id]
  assert turns.count_in(bpe, char, b_ids) == len(c_ids) == 1 + 9 + 1 + 1 + 3 + 1 + 5 + 1
  assert turns.count_in(char, char, c_ids) == len(c_ids)
  assert turns.count_in(char, bpe, c_ids) == len(b_ids) < len(c_ids)


def test_budget_count_with_is_refused_for_record_domains():
  import os
  from configs import files
  from mopd_jax import configure
  c = files.get_config(os.path.join(ROOT, "examples", "spec.json"))
  c.budget.count_with = "char"
  with pytest.raises(ValueError, match="record domains .* measure their b0 in the run's"):
    configure.build(c, 1)


def test_an_engine_measures_responses_in_the_tokens_budgets_are_counted_in(bpe_teachers):
  """`RolloutEngine.result`, the one place a response meets its budget: an engine writing
  BPE tokens that counts in characters reports character lengths, and a finished response
  longer than its budget in characters is over it though its BPE length fits; without a
  counting tokenizer, lengths are the engine's own tokens. Lengths an earlier result
  measured are taken as given."""
  import configs.qwen3_mopd as q
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io import hf
  from mopd_jax.io.tokenizer import CharTokenizer, load_tokenizer
  from mopd_jax.rollout import turns
  char = CharTokenizer()
  bpe = load_tokenizer(bpe_teachers[0], options=TokenizerOptions(chat=False))
  cfg = hf.resolve_model_config(q.get_config("tiny").teacher, bpe.vocab_size)
  text = "2,2,0,2,0,1,1,1\n#1"
  ids = bpe.encode(text) + [bpe.eos_id]
  n_char = len(char.encode(text)) + 1
  assert len(ids) < n_char
  traj = lambda finished: turns.Trajectory(prompt_ids=[1], ids=list(ids), gen_mask=[1] * len(ids),
                                           logprobs=[0.0] * len(ids), finished=finished)
  counting = turns.RolloutEngine(cfg, bpe, max_response_tokens=64, count_tok=char)
  res = counting.result([traj(True), traj(True), traj(False)], [n_char, n_char - 1, n_char])
  assert res.lengths.tolist() == [n_char] * 3
  assert res.over_budget.tolist() == [False, True, True]
  assert res.texts == [bpe.decode(ids)] * 3
  # A second result of the same trajectories (a step's own budgets after the sampler's) takes
  # the lengths the first measured rather than counting them again; the engine's own
  # tokens ignore them.
  again = counting.result([traj(True)] * 2, [n_char + 1, n_char - 1], counted=res.lengths[:2])
  assert again.lengths.tolist() == [n_char] * 2 and again.over_budget.tolist() == [False, True]
  assert counting.result([traj(True)], [n_char], counted=[n_char + 1]).over_budget.tolist() == [
      True]
  own = turns.RolloutEngine(cfg, bpe, max_response_tokens=64)
  assert own.result([traj(True)], [len(ids)], counted=[999]).lengths.tolist() == [len(ids)]
  res = own.result([traj(True), traj(True)], [len(ids), n_char - 1])
  assert res.lengths.tolist() == [len(ids)] * 2 and not res.over_budget.any()
  assert own.result([traj(True)], [len(ids) - 1]).over_budget.tolist() == [True]


def test_held_out_log_ratio_across_tokenizers_sums_to_the_sequence_log_ratio(bpe_teachers):
  """`agreement.logratio_rows`, the held-out measure with teachers of another tokenizer:
  each rollout's row sums to log pi(y) - log pi_T(y), the teacher's log-probability of the
  response in its own tokens after its own prompt (scored here separately, float tolerance),
  spread over the student's generated tokens and 0 elsewhere."""
  from mopd_jax import models
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.evaluation import agreement
  from mopd_jax.io.tokenizer import load_tokenizer
  from mopd_jax.models import logprobs
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.tasks import get_task, views
  from mopd_jax.teachers import alignment, bank as teachers
  from mopd_jax.training import mopd
  efforts = ("low", "high", "max")
  tok = load_tokenizer("char", efforts=efforts)
  bpe = load_tokenizer(bpe_teachers[0], options=TokenizerOptions(chat=False))
  cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=32,
                          quant="none")
  tcfg = models.get_preset("toy", vocab_size=bpe.vocab_size, num_layers=1, d_model=32,
                           quant="none")
  student = models.init_params(cfg, jax.random.PRNGKey(0))
  cells = [(d, e) for d in ("gen", "cod") for e in efforts]
  bank = teachers.build_bank(tcfg, {f"{d}/{e}": models.init_params(tcfg, jax.random.PRNGKey(k))
                                    for k, (d, e) in enumerate(cells)})
  tasks = {d: get_task(d) for d in ("gen", "cod")}
  rows, shown, trajs, texts = [], [], [], []
  for d, e in cells:
    for ex in tasks[d].generate(3, 2):
      ids = tok.encode(ex.solutions[sorted(ex.solutions)[0]]) + [tok.eos_id]
      rows.append(ex)
      shown.append(e)
      trajs.append(rollout.Trajectory(rollout.encode_prompt(tok, ex, e), ids, [1] * len(ids),
                                      [0.0] * len(ids), True))
      texts.append(tok.decode(ids))
  setup = mopd.StepSetup(bank, rollout.RolloutEngine(cfg, tok, max_response_tokens=64), tasks,
                         cells, {"low": 0.3, "high": 0.72, "max": 1.5}, 32, views.K3,
                         teacher_tok=bpe)
  sampled = mopd._assemble(setup, rows, shown, trajs=trajs, texts=texts,  # pylint: disable=protected-access
                           rows_per_teacher=2)
  sampled.arr["sampler_logprobs"] = np.asarray(logprobs.token_logprobs(
      cfg, student, sampled.arr["tokens"], input_mask=sampled.arr["input_mask"]))
  got = agreement.logratio_rows(bank, sampled)
  mask = np.asarray(sampled.arr["loss_mask"], bool)
  assert (got[~mask] == 0).all() and np.isfinite(got).all()
  for i, (t, ex) in enumerate(zip(trajs, rows)):
    t_ids, _ = alignment.retokenize(tok, bpe, t.ids)
    prompt = rollout.encode_prompt(bpe, ex, None)
    full = np.asarray([prompt + t_ids])
    lp_t = np.asarray(logprobs.token_logprobs(tcfg, jax.tree.map(
        lambda x, k=i // 2: x[k], bank.params), full))[0, len(prompt):].sum()
    lp_s = sampled.arr["sampler_logprobs"][i][mask[i]].sum()
    np.testing.assert_allclose(got[i].sum(), lp_s - lp_t, rtol=1e-4, atol=1e-3)


def test_the_cross_tokenizer_summary_reads_each_seeds_report(tmp_path):
  """`experiments.cross_tokenizer`'s per-seed row: the student's expected results apart from
  the others, the held-out sampled log-ratio of pi_SFT, the initialised and the final
  student, the span log-ratio's first and last tenth of the MOPD steps."""
  from experiments import cross_tokenizer
  seed_dir = tmp_path / "seed_3"  # sweep.seed_dir
  (seed_dir / "mopd").mkdir(parents=True)
  history = [{"kl": 0.3 - 0.01 * i, "unaligned_rows": float(i == 4),
              "teacher_multi_token_share": 0.4} for i in range(20)]
  (seed_dir / "mopd" / "history.json").write_text(json.dumps(history))
  held = {p: {"kl_exact": k, "kl_exact_se": 0.01, "measure": "sampled",
              "tail": {"p50": k / 100, "p99": k * 3}}
          for p, k in (("sft", 0.6), ("init", 0.2), ("student", 0.1))}
  checks = [{"name": "student gen/high accuracy / teacher's", "ok": False},
            {"name": "student gen/max accuracy / teacher's", "ok": True},
            {"name": "teacher gen/max accuracy - pi_SFT gen/max accuracy", "ok": False},
            {"name": "held-out exact KL, pi_SFT / the initialised student", "ok": None}]
  (seed_dir / "report.json").write_text(json.dumps({"checks": checks, "kl_heldout": held}))
  row = cross_tokenizer.seed_row(str(tmp_path), 3, 0.38)
  assert row["student_met"] == 1 and row["student_total"] == 2
  assert row["student_missed"] == ["student gen/high accuracy / teacher's"]
  assert row["missed"] == ["teacher gen/max accuracy - pi_SFT gen/max accuracy"]
  assert row["heldout"] == [(0.6, 0.01), (0.2, 0.01), (0.1, 0.01)]
  assert row["first"] == pytest.approx(0.295) and row["last"] == pytest.approx(0.115)
  assert row["unaligned"] == 1.0 and row["multi"] == pytest.approx(0.4)
  text = cross_tokenizer.summary(str(tmp_path), [row])
  assert ("| 3 | 0.40 | 1 | 0.600 ± 0.010 / 0.200 ± 0.010 / 0.100 ± 0.010 | 0.0020 / 0.0010 | "
          "0.6000 / 0.3000 | 0.295 / 0.115 | "
          "1 of 2: missed student gen/high accuracy / teacher's | teacher gen/max accuracy - "
          "pi_SFT gen/max accuracy |") in text
  assert (tmp_path / "cross_tokenizer.md").read_text() == text


def test_claim_split_separates_copying_a_claim_from_computing_the_value():
  """`common.claim_split` (what `experiments.memo_probe` prints): a policy that copies the
  claim, one that computes the true value, and one that cannot tell the true value from
  the others on the prompts whose claim is stale."""
  from experiments import common
  claimed, true = np.array([0, 1, 2, 0]), np.array([0, 1, 1, 2])  # the last two are stale
  copy = np.eye(3)[claimed] * 0.8 + 0.2 / 3
  s = common.claim_split(copy, claimed=claimed, true=true)
  assert s["stale"]["prompts"] == 2 and s["fresh"]["prompts"] == 2
  assert np.isclose(s["stale"]["claimed"], 0.8 + 0.2 / 3)
  assert np.isclose(s["stale"]["true"], 0.2 / 3) and np.isclose(s["stale"]["other"], 0.2 / 3)
  assert s["stale"]["argmax"] == {"true": 0.0, "claimed": 1.0}
  s = common.claim_split(2 * np.eye(3)[true], claimed=claimed, true=true)  # renormalised
  assert s["stale"]["argmax"]["true"] == 1.0 and s["fresh"]["claimed"] == 1.0
  blind = np.array([[1, 0, 0], [0, 1, 0], [0.3, 0.3, 0.4], [0.4, 0.3, 0.3]])
  s = common.claim_split(blind, claimed=claimed, true=true)
  assert np.isclose(s["stale"]["true"], s["stale"]["other"])
  assert np.isclose(s["stale"]["claimed"], 0.4)
