"""Multi-host by simulation: 2 processes x 2 CPU devices (gloo collectives) run SFT and MOPD
steps and must match this process running the same steps on 4 devices; plus the launch
settings and per-process row arithmetic."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import multihost_worker
from test_teacher_families import two_families  # noqa: F401  (a fixture)
from mopd_jax.runtime import distributed, sharding
import suite_cli

ROOT = suite_cli.ROOT


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_processes(commands, envs, timeout):
  """Start one process per (command, env), wait for all, kill stragglers; returns the logs
  after asserting every process exited 0."""
  procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT) for cmd, env in zip(commands, envs)]
  try:
    logs = [p.communicate(timeout=timeout)[0].decode() for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
  return logs


def test_two_processes_equal_one_process(tmp_path):  # ~100 s on 2 cores: 2 workers + reference
  coordinator = f"localhost:{_free_port()}"
  env = {k: v for k, v in suite_cli.env().items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  server = multihost_worker.serve_teachers()
  try:
    _run_processes([[sys.executable, os.path.join(ROOT, "tests", "multihost_worker.py"),
                     "--process_id", str(i), "--num_processes", "2", "--coordinator",
                     coordinator, "--workdir", str(tmp_path / "multi"), "--server", server.url]
                    for i in range(2)], [env, env], 240)
    multi = np.load(tmp_path / "multi" / "result.npz")
    mesh = sharding.make_mesh(multihost_worker.MESH, jax.devices()[:4])
    ref = multihost_worker.run_steps(mesh, str(tmp_path / "single"))
    ref.update(multihost_worker.relayed_scores(server.url))
  finally:
    server.stop()
  # Served teachers on two processes: process 0's answers on both, equal to asking alone;
  # a server that is not there, and a refused start, raise on both processes.
  assert ref["relayed_tk_ids"].shape == ref["relayed_lp"].shape + (2,)
  assert "unavailable" in str(ref["relayed_down"])
  for i in range(2):
    got = np.load(tmp_path / "multi" / f"relayed_{i}.npz")
    for key in ("relayed_lp", "relayed_tk_lp", "relayed_tk_ids"):
      np.testing.assert_array_equal(got[key], ref[key], err_msg=f"process {i} {key}")
    assert str(got["relayed_down"]) == str(ref["relayed_down"])
    assert str(got["relayed_refused"]) == "a start-up check refused"

  np.testing.assert_allclose(multi["sft_loss"], ref["sft_loss"], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(multi["mopd_loss"], ref["mopd_loss"], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(multi["teacher_lp"], np.stack(ref["teacher_lp"]), atol=1e-5)
  for i, p in enumerate(ref["params"]):
    np.testing.assert_allclose(multi[f"param_{i}"], p, atol=1e-5, err_msg=f"param {i}")
  assert bool(multi["restored_equal"]) and ref["restored_equal"]
  # Teachers of two families (the second of another vocabulary) score alike on two
  # processes; an HF checkpoint read onto the 2-process mesh holds what was written.
  np.testing.assert_allclose(multi["mixed_lp"], ref["mixed_lp"], atol=1e-5)
  assert np.isfinite(ref["mixed_lp"]).all() and ref["mixed_lp"][1].min() < 0
  assert bool(multi["hf_equal"]) and ref["hf_equal"]
  # Record domains' grain iterator: each process read only its own shard (disjoint halves),
  # both got the same global batches, each resumed exactly.
  g = [np.load(tmp_path / "multi" / f"grain_{i}.npz") for i in range(2)]
  np.testing.assert_array_equal(g[0]["grain_global"], g[1]["grain_global"])
  assert not set(g[0]["grain_read"]) & set(g[1]["grain_read"])
  assert set(g[0]["grain_read"]) | set(g[1]["grain_read"]) <= set(range(40))
  assert all(bool(x["grain_resumed_equal"]) for x in g)
  local = g[0]["grain_global"][:, :4]  # process 0's rows of each global batch
  assert set(local.ravel()) <= set(g[0]["grain_read"])
  # Logs from process 0 only: one line per step, not one per process.
  with open(tmp_path / "multi" / "logs" / "metrics.jsonl") as f:
    assert len(f.read().splitlines()) == 2 * multihost_worker.STEPS


PIPELINE_FLAGS = ("--config", "configs/toy.py:tiny", "--config.mesh.data=2",
                  "--config.mesh.tensor=2", "--config.mopd.prompts_per_cell=2")


@pytest.mark.slow  # the whole tiny pipeline twice: ~5 min on 2 processes, ~2.5 min on 1
def test_pipeline_on_two_processes(tmp_path):
  """`experiments.run` launched as 2 processes x 2 CPU devices runs every stage on one
  global 4-device mesh (data 2 x tensor 2) and matches the 1-process 4-device run: SFT
  params within 1e-5, the first RL iteration of each domain, MOPD's first rollouts."""
  coordinator = f"localhost:{_free_port()}"
  base = suite_cli.env(devices=2)
  multi = str(tmp_path / "multi")
  _run_processes(
      [[sys.executable, "-m", "experiments.run", *PIPELINE_FLAGS, "--workdir", multi]] * 2,
      [{**base, "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(i)} for i in range(2)], 900)
  single = str(tmp_path / "single")
  ref = subprocess.run([sys.executable, "-m", "experiments.run", *PIPELINE_FLAGS, "--workdir",
                        single], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=suite_cli.env(devices=4))
  assert ref.returncode == 0, ref.stderr[-3000:]

  from mopd_jax.io import checkpoint
  for stage in ("data", "sft", "rl", "mopd", "eval", "report"):
    assert os.path.exists(os.path.join(multi, stage, "DONE.json")), stage
  a = jax.tree.leaves(checkpoint.load_params(os.path.join(multi, "sft", "params")))
  b = jax.tree.leaves(checkpoint.load_params(os.path.join(single, "sft", "params")))
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, atol=1e-5)
  # Later stages sample; Adam turns rounding-level gradient differences into ~lr-sized
  # parameter differences, which after a few updates can flip a sampled token. So they are
  # compared where both runs start from the same (SFT) params: each max lane's first
  # iteration (reward and length of its rollouts) and MOPD's first rollouts.
  ta = json.load(open(os.path.join(multi, "teachers.json")))["teachers"]
  tb = json.load(open(os.path.join(single, "teachers.json")))["teachers"]
  assert set(ta) == set(tb) and len(ta) == 9
  for name in ta:
    assert len(ta[name]["train_curve"]) == len(tb[name]["train_curve"]), name
    if name.endswith("/max"):
      assert ta[name]["train_curve"][0] == tb[name]["train_curve"][0], name
  ha = json.load(open(os.path.join(multi, "mopd", "history.json")))
  hb = json.load(open(os.path.join(single, "mopd", "history.json")))
  assert len(ha) == len(hb) and ha[0]["length"] == hb[0]["length"]
  # One writer (process 0): as many metric lines as the single-process run, not twice as many.
  lines = lambda wd: open(os.path.join(wd, "tb", "mopd", "metrics.jsonl")).read().splitlines()
  assert len(lines(multi)) == len(lines(single)) > 0
  assert os.path.exists(os.path.join(multi, "report.md"))


def test_settings_from_config_and_environment():
  assert distributed.settings({}, environ={}) is None  # single process
  got = distributed.settings({}, environ={"JAX_COORDINATOR_ADDRESS": "h0:1234",
                                          "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"})
  assert got == {"coordinator_address": "h0:1234", "num_processes": 4, "process_id": 3}
  cfg = dict(coordinator_address="c:1", num_processes=2, process_id=1)
  assert distributed.settings(cfg, environ={"JAX_PROCESS_ID": "0"})["process_id"] == 1
  assert distributed.settings(dict(initialize=True), environ={}) == {}  # JAX auto-detects
  with pytest.raises(ValueError, match="process_id=2 is not below num_processes=2"):
    distributed.settings(dict(coordinator_address="c:1", num_processes=2, process_id=2), {})
  with pytest.raises(ValueError, match="no coordinator address"):
    distributed.settings(dict(num_processes=2), environ={})


def test_process_rows_single_process():
  mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=2))
  assert distributed.process_rows(mesh, 8) == slice(0, 8)
  with pytest.raises(ValueError, match="not divisible"):
    distributed.process_rows(mesh, 6)
  got = distributed.global_batch(mesh, {"x": np.arange(16).reshape(8, 2)}, 8)
  np.testing.assert_array_equal(got["x"], np.arange(16).reshape(8, 2))
  assert got["x"].sharding.spec == sharding.batch_spec(2)


def _one_and_two_processes(tmp_path, flags, later=lambda single: ()) -> tuple:
  """`experiments.run` with `flags` on 1 process x 4 CPU devices (the data, SFT and RL
  stages, then the MOPD, eval and report stages with the flags `later(workdir)` adds), and
  the MOPD, eval and report stages again on 2 processes x 2 devices from a copy of its data,
  SFT and RL stages; (the 1-process workdir, the 2-process one, process 0's log)."""
  import shutil
  single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
  run = lambda *more: subprocess.run(
      [sys.executable, "-m", "experiments.run", *flags, "--workdir", single, *more], cwd=ROOT,
      capture_output=True, text=True, timeout=900, env=suite_cli.env(devices=4))
  ref = run("--config.stages=data,sft,rl")
  assert ref.returncode == 0, ref.stderr[-3000:]
  extra = tuple(later(single))
  ref = run("--config.stages=mopd,eval,report", *extra)
  assert ref.returncode == 0, ref.stderr[-3000:]
  os.makedirs(multi)
  for name in ("data", "sft", "rl", "teachers.json"):
    (shutil.copytree if os.path.isdir(os.path.join(single, name)) else shutil.copy)(
        os.path.join(single, name), os.path.join(multi, name))
  coordinator = f"localhost:{_free_port()}"
  base = suite_cli.env(devices=2)
  logs = _run_processes(
      [[sys.executable, "-m", "experiments.run", *flags, "--workdir", multi,
        "--config.stages=mopd,eval,report", *extra]] * 2,
      [{**base, "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": str(i)} for i in range(2)], 900)
  return single, multi, logs[0]


def _same_mopd_and_eval(single: str, multi: str, cells) -> None:
  """The two runs' MOPD steps (char_kl: losses within 1e-5) and eval (accuracies and lengths
  identical, every cell's teacher measured, held-out log-ratio within 1e-5) agree."""
  ha = json.load(open(os.path.join(multi, "mopd", "history.json")))
  hb = json.load(open(os.path.join(single, "mopd", "history.json")))
  assert len(ha) == len(hb) > 0
  for a, b in zip(ha, hb):
    assert a["char_positions"] == b["char_positions"] > 0 and a["length"] == b["length"]
    np.testing.assert_allclose([a["loss"], a["char_kl"]], [b["loss"], b["char_kl"]], rtol=1e-5)
  ea = json.load(open(os.path.join(multi, "eval.json")))
  eb = json.load(open(os.path.join(single, "eval.json")))
  key = lambda c: (c["policy"], c["domain"], c["effort"])
  assert ({key(c): (c["accuracy"], c["mean_length"]) for c in ea["cells"]}
          == {key(c): (c["accuracy"], c["mean_length"]) for c in eb["cells"]})
  assert {key(c)[1:] for c in ea["cells"] if c["policy"] == "teacher"} == {
      tuple(c.split("/")) for c in cells}
  for policy, h in eb["kl_heldout"].items():
    assert h["measure"] == "sampled"
    np.testing.assert_allclose(ea["kl_heldout"][policy]["kl_exact"], h["kl_exact"], rtol=1e-5)
  assert os.path.exists(os.path.join(multi, "report.md"))


def _family_flags(two_families) -> tuple:
  from test_teacher_families import BPE_CELLS
  path, paths = two_families
  return ("--config", "configs/qwen3_mopd.py:tiny", "--config.mesh.data=2",
          "--config.mesh.tensor=2", "--config.mopd.prompts_per_cell=2",
          "--config.mopd.loss=char_kl", "--config.eval.kl_rollouts=2",
          "--config.teacher.hf_paths=" + ",".join(f"{c}={p}" for c, p in paths.items()),
          "--config.teacher.tokenizer_paths=" + ",".join(f"{c}={path}" for c in BPE_CELLS))


@pytest.mark.slow  # ~3 min on 2 cores: every stage on 1 process, MOPD and eval on 2
def test_two_families_on_two_processes(tmp_path, two_families):
  """Teachers of two families (BPE `gen` and `agt` teachers beside character-vocabulary
  `cod` ones) on 2 processes x 2 CPU devices: the MOPD steps with the next-character loss
  and the eval's held-out log-ratio and accuracies equal those of 1 process on 4 devices,
  from the same data, SFT and RL stages."""
  single, multi, log = _one_and_two_processes(tmp_path, _family_flags(two_families))
  assert "2 teacher families" in log
  _same_mopd_and_eval(single, multi, two_families[1])


@pytest.mark.slow  # ~4 min on 2 cores
def test_served_teachers_on_two_processes(tmp_path, two_families):
  """The same teachers behind two servers (one per family, whole distributions): on 2
  processes process 0 alone asks them and relays what it gets (`teachers/relayed.py`); the
  MOPD steps (char_kl through the servers) and the eval equal those of 1 process."""
  import configs.qwen3_mopd as q
  from mopd_jax import serve
  from mopd_jax.teachers import server
  from test_teacher_families import BPE_CELLS
  flags = _family_flags(two_families)
  servers = []

  def serve_them(single):  # the run's teachers (its manifest), a server per family
    c = q.get_config("tiny")
    c.mesh.data = jax.device_count()
    c.mopd.prompts_per_cell = jax.device_count()
    c.mopd.loss = "mopd"
    c.teacher.hf_paths, c.teacher.tokenizer_paths = (f.split("=", 1)[1] for f in flags[-2:])
    bank, tok = serve.bank_from_config(c, teachers_path=os.path.join(single, "teachers.json"))
    others = tuple(x for x in two_families[1] if x not in BPE_CELLS)
    for cells in (BPE_CELLS, others):
      [(part, part_tok)] = serve.family_banks(bank, tok, cells)
      servers.append((cells, server.TeacherServer(
          part, part_tok, temperature=c.mopd.teacher_temperature,
          max_logprobs=part_tok.vocab_size)))
    urls = {cell: url for cells, url in [(cells, s.start()) for cells, s in servers]
            for cell in cells}
    return ("--config.teacher.served_top_k=100000", "--config.teacher.endpoints=" +
            ",".join(f"{cell}={u}" for cell, u in urls.items()))
  try:
    single, multi, log = _one_and_two_processes(tmp_path, flags, later=serve_them)
  finally:
    for _, s in servers:
      s.stop()
  assert "parity probe against the run's own teachers" in log
  _same_mopd_and_eval(single, multi, two_families[1])
