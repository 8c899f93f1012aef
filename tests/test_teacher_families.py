"""Teachers of several families in one run (`teacher.tokenizer_paths`): a bank per family
(mopd_jax/teachers/families.py), each scoring its own teachers' rows; every stage with
cells of a BPE family beside cells of the student's tokenizer."""
import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import suite_cli
from test_cross_tokenizer import CELLS, _run, toy_texts

ROOT = suite_cli.ROOT
BPE_CELLS = tuple(c for c in CELLS if not c.startswith("cod/"))


@pytest.fixture(scope="module")
def two_families(tmp_path_factory):
  """(BPE tokenizer.json, {cell: checkpoint}): tiny teachers of a BPE vocabulary for the
  `gen` and `agt` cells and of the student's character vocabulary for the `cod` cells."""
  import configs.qwen3_mopd as q
  from mopd_jax import models
  from mopd_jax.config.tokenizer_options import TokenizerOptions
  from mopd_jax.io import bpe, hf
  from mopd_jax.io.tokenizer import SPECIALS, CharTokenizer, load_tokenizer
  root = tmp_path_factory.mktemp("families")
  path = bpe.fit(toy_texts(), str(root / "tok"), vocab_size=400, specials=SPECIALS)
  bpe_tok = load_tokenizer(path, options=TokenizerOptions(chat=False))
  paths = {}
  for i, cell in enumerate(CELLS):
    vocab = bpe_tok.vocab_size if cell in BPE_CELLS else CharTokenizer().vocab_size
    tcfg = hf.resolve_model_config(q.get_config("tiny").teacher, vocab)
    paths[cell] = str(root / f"t{i}")
    hf.save_checkpoint(tcfg, jax.device_get(models.init_params(tcfg, jax.random.PRNGKey(i))),
                       paths[cell])
  return path, paths


def _bank(cfg, names, seed):
  from mopd_jax import models
  from mopd_jax.teachers import bank
  return bank.build_bank(cfg, [models.init_params(cfg, jax.random.PRNGKey(seed + i))
                               for i in range(len(names))], names=names)


def test_a_mixed_bank_scores_each_family_with_its_own_bank():
  """Each family's teachers score their rows of the stratified batch exactly as their own
  bank does; rows of another vocabulary never reach a bank of the wrong size."""
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer, fingerprint
  from mopd_jax.teachers import bank, families
  small = models.get_preset("toy")
  toks = (CharTokenizer(), CharTokenizer(charset="0123456789"))
  other = dataclasses.replace(small, vocab_size=300)
  a, b = _bank(small, ("gen/low", "cod/low"), 0), _bank(other, ("gen/max",), 10)
  mixed = families.MixedBank(
      parts=(a, b), router=bank.Router(("gen/low", "gen/max", "cod/low")),
      families=(families.Family(tok=toks[0], path="", model_cfg=small,
                                cells=("gen/low", "cod/low"), cross=False),
                families.Family(tok=toks[1], path="x", model_cfg=other, cells=("gen/max",),
                                cross=True)))
  assert [m.tolist() for m in mixed.members] == [[0, 2], [1]]
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, small.vocab_size, (3, 2, 16)).astype(np.int32)
  tokens[1] = rng.integers(small.vocab_size, 300, (2, 16))  # ids only the 300-vocab reads
  mask = np.ones((3, 2, 16), bool)
  got = np.asarray(families.score_stratified(mixed, tokens, mask))
  want_a = np.asarray(bank.score_stratified(a, tokens[[0, 2]], mask[[0, 2]]))
  want_b = np.asarray(bank.score_stratified(b, tokens[[1]], mask[[1]]))
  np.testing.assert_array_equal(got[[0, 2]], want_a)
  np.testing.assert_array_equal(got[[1]], want_b)
  from mopd_jax.runtime import sharding
  mesh = sharding.make_mesh({"data": 2}, devices=jax.devices()[:2])
  from mopd_jax.teachers import placement
  scorer = families.MixedScorer(mixed, mesh, mesh)
  assert [p.info().tokenizer_hash for p in scorer.parts] == [fingerprint(t) for t in toks]
  scored = np.asarray(scorer(tokens, mask))
  np.testing.assert_array_equal(scored[[0, 2]], np.asarray(
      placement.TeacherScorer(a, mesh, mesh)(tokens[[0, 2]], mask[[0, 2]])))
  np.testing.assert_array_equal(scored[[1]], np.asarray(
      placement.TeacherScorer(b, mesh, mesh)(tokens[[1]], mask[[1]])))
  params, cfg, _ = mixed.teacher(1)
  assert cfg is other and {x.shape[0] for x in jax.tree.leaves(params)} >= {300}
  with pytest.raises(ValueError, match="not each of the cells"):
    families.MixedBank(parts=(a,), router=mixed.router, families=mixed.families[:1])


def test_every_stage_runs_with_teachers_of_two_families(tmp_path, two_families):
  """Every stage with BPE teachers for `gen` and `agt` and teachers of the student's
  tokenizer for `cod`: the manifest records each cell's tokenizer, the MOPD steps score
  every cell (the student-tokenizer cells' spans one token each), the eval measures each
  teacher in its own tokens, and the report counts the two origins apart; then the same
  teachers served by two servers (`_served_by_two_families`)."""
  path, paths = two_families
  hf_paths = "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in paths.items())
  tok_paths = "--config.teacher.tokenizer_paths=" + ",".join(f"{c}={path}" for c in BPE_CELLS)
  proc = _run(tmp_path, hf_paths, tok_paths, "--config.eval.kl_rollouts=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "2 teacher families" in proc.stdout + proc.stderr
  manifest = json.load(open(tmp_path / "wd" / "teachers.json"))
  for cell, entry in manifest["teachers"].items():
    assert entry["tokenizer"]["other"] == (cell in BPE_CELLS)
    assert entry["tokenizer"]["path"] == (path if cell in BPE_CELLS else "")
  history = json.load(open(tmp_path / "wd" / "mopd" / "history.json"))
  for rec in history:
    assert rec["unaligned_rows"] == 0.0 and 0 < rec["teacher_multi_token_share"] < 1
    assert set(rec["cells"]) == set(CELLS)
    assert all(np.isfinite(c["kl"]) for c in rec["cells"].values())
  cells = json.load(open(tmp_path / "wd" / "eval.json"))["cells"]
  teachers = {f"{c['domain']}/{c['effort']}" for c in cells if c["policy"] == "teacher"}
  assert teachers == set(CELLS)
  held = json.load(open(tmp_path / "wd" / "eval.json"))["kl_heldout"]
  for h in held.values():
    assert h["measure"] == "sampled" and np.isfinite(h["kl_exact"]) and h["rollouts"] > 0
  report = json.load(open(tmp_path / "wd" / "report.json"))
  assert set(report["kl"]["initial_by_origin"]) == {"other tokenizer", "same"}
  by_cell = report["kl"]["initial_by_cell"]
  assert {c for c, v in by_cell.items() if v["origin"] == "other tokenizer"} == set(BPE_CELLS)
  # A loss over one vocabulary is refused for such a run, at config time, in one line.
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/qwen3_mopd.py:tiny", "--workdir", str(tmp_path / "wd2"),
                         "--config.stages=mopd", "--config.mopd.loss=vocab_kl", hf_paths,
                         tok_paths], cwd=ROOT, env=suite_cli.env(), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2 and "config error:" in proc.stderr
  assert "use mopd.loss='mopd'" in proc.stderr
  # The char_kl loss with both families: every row gets its own family's next-character
  # targets (the BPE cells' partial tokens branch), every cell is trained; the teachers on
  # devices of their own (disaggregated: each family's passes run there).
  (tmp_path / "char").mkdir()
  shutil.copytree(tmp_path / "wd", tmp_path / "char" / "wd",
                  ignore=shutil.ignore_patterns("mopd", "eval*", "report*"))
  proc = _run(tmp_path / "char", hf_paths, tok_paths, "--config.mopd.loss=char_kl",
              "--config.placement.teachers=disaggregated",
              "--config.placement.teacher_mesh.data=1", stages="mopd", devices=2)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for rec in json.load(open(tmp_path / "char" / "wd" / "mopd" / "history.json")):
    assert rec["char_positions"] > 0 and rec["char_branches"] > 0
    assert np.isfinite(rec["char_kl"]) and rec["char_kl"] > 0
    assert set(rec["cells"]) == set(CELLS) and rec["unaligned_rows"] == 0.0
  _served_by_two_families(tmp_path, two_families)


def _served_by_two_families(tmp_path, two_families):
  """The same teachers through `teacher.endpoints` (the MOPD stage again on the run's
  workdir): a server of the BPE teachers for `gen` and `agt`, one of the
  character-vocabulary teachers for `cod`; each passes the start-up checks against its own
  family's tokenizer and the parity probe against the run's own copies, and the MOPD steps
  score every cell through them. The servers' banks are what `python -m mopd_jax.serve
  --cells` builds (a family each; without `--cells` the entry point refuses the manifest of
  two families). One server named for cells of both families is refused in one line."""
  import configs.qwen3_mopd as q
  from mopd_jax import serve
  from mopd_jax.teachers import server
  path, paths = two_families
  hf_paths = "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in paths.items())
  tok_paths = "--config.teacher.tokenizer_paths=" + ",".join(f"{c}={path}" for c in BPE_CELLS)
  # The serve entry point's banks: a server holds one family, named by --cells.
  c = q.get_config("tiny")
  c.mesh.data = jax.device_count()  # the suite's simulated devices
  c.mopd.prompts_per_cell = jax.device_count()
  c.mopd.loss = "mopd"
  c.teacher.hf_paths = hf_paths.split("=", 1)[1]
  c.teacher.tokenizer_paths = tok_paths.split("=", 1)[1]
  bank, tok = serve.bank_from_config(c, teachers_path=str(tmp_path / "wd" / "teachers.json"))
  assert tok is None and len(serve.family_banks(bank, tok)) == 2
  servers = []
  for cells in (BPE_CELLS, tuple(x for x in CELLS if x not in BPE_CELLS)):
    [(part, part_tok)] = serve.family_banks(bank, tok, cells)
    assert tuple(part.router.names) == cells
    servers.append((cells, server.TeacherServer(part, part_tok,  # whole distributions
                                                temperature=c.mopd.teacher_temperature,
                                                max_logprobs=part_tok.vocab_size)))
  [(whole, _)] = serve.family_banks(bank, tok, BPE_CELLS)
  [(one, _)] = serve.family_banks(bank, tok, [BPE_CELLS[1]])
  assert one.router.names == (BPE_CELLS[1],)
  np.testing.assert_array_equal(  # the cell's own teacher, cut out of its family's stack
      np.asarray(jax.tree.leaves(one.params)[0][0]),
      np.asarray(jax.tree.leaves(whole.params)[0][1]))
  with pytest.raises(ValueError, match="do not hold"):
    serve.family_banks(bank, tok, ["gen/none"])
  proc = subprocess.run([sys.executable, "-m", "mopd_jax.serve", "--config",
                         "configs/qwen3_mopd.py:tiny", "--config.mopd.loss=mopd", hf_paths,
                         tok_paths, "--teachers", str(tmp_path / "wd" / "teachers.json")],
                        cwd=ROOT, env=suite_cli.env(), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode != 0 and "serve each family with --cells" in proc.stderr
  try:
    started = [(cells, s.start()) for cells, s in servers]
    urls = {cell: url for cells, url in started for cell in cells}
    shutil.rmtree(tmp_path / "wd" / "mopd")
    # The char_kl loss through the servers, each position's whole next-token distribution
    # read (served_top_k at least either vocabulary): the steps of the in-process run above.
    proc = _run(tmp_path, hf_paths, tok_paths,
                "--config.teacher.endpoints=" + ",".join(f"{c}={u}" for c, u in urls.items()),
                "--config.mopd.loss=char_kl", "--config.teacher.served_top_k=100000",
                stages="mopd")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "parity probe against the run's own teachers" in proc.stdout
    history = json.load(open(tmp_path / "wd" / "mopd" / "history.json"))
    in_process = json.load(open(tmp_path / "char" / "wd" / "mopd" / "history.json"))
    assert len(history) == len(in_process)
    for rec, want in zip(history, in_process):
      assert rec["unaligned_rows"] == 0.0 and set(rec["cells"]) == set(CELLS)
      assert all(np.isfinite(v["kl"]) for v in rec["cells"].values())
      assert rec["char_positions"] == want["char_positions"] > 0
      np.testing.assert_allclose([rec["loss"], rec["char_kl"]], [want["loss"], want["char_kl"]],
                                 rtol=1e-5)
      # Eq. 15's scores, read from the targets' own request: the in-process run's.
      for cell, v in rec["cells"].items():
        np.testing.assert_allclose(v["kl"], want["cells"][cell]["kl"], rtol=1e-4, atol=1e-6)
    one = urls[BPE_CELLS[0]]
    shutil.rmtree(tmp_path / "wd" / "mopd")
    proc = _run(tmp_path, hf_paths, tok_paths,
                "--config.teacher.endpoints=" + ",".join(f"{c}={one}" for c in CELLS),
                stages="mopd")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"teacher server {one} serves" in proc.stderr
    assert "cells of teachers of different families" in proc.stderr
  finally:
    for _, s in servers:
      s.stop()


def test_a_missing_tokenizer_of_one_cell_is_one_config_error(tmp_path, two_families):
  """A cell's tokenizer file that does not exist: one `config error:` line naming the
  cell's field, exit status 2."""
  _, paths = two_families
  hf_paths = "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in paths.items())
  proc = _run(tmp_path, hf_paths, f"--config.teacher.tokenizer_paths=gen/low={tmp_path}/no.json",
              stages="mopd")
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "config error: teacher.tokenizer_paths['gen/low']=" in proc.stderr



def test_a_cells_tokenizer_that_reads_as_the_default_is_the_default(tmp_path, two_families):
  """`teacher.tokenizer_paths` naming, for the grid's first cell, a copy of the
  `teacher.tokenizer_path` file: that cell reads the same tokenizer object as every other
  cell, so the run has one family, whatever the grid's order."""
  import configs.toy as toy
  from mopd_jax import configure
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.stages import context
  path, ckpts = two_families
  copy = tmp_path / "copy.json"
  shutil.copy(path, copy)
  c = toy.get_config("two_families")
  c.teacher.hf_paths = ",".join(f"{cell}={ckpts[cell]}" for cell in CELLS)
  c.teacher.tokenizer_path = path
  c.teacher.tokenizer_paths = f"{CELLS[0]}={copy}"
  rc = configure.build(c, 1)
  tok = CharTokenizer()
  default = context.teacher_tokenizer(rc, tok)
  toks = context.teacher_tokenizers(rc, tok, default)
  assert all(t is default for t, _ in toks.values())
