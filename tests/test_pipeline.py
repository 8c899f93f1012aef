"""The whole pipeline on the tiny toy config: every stage runs, outputs are where they belong,
re-running skips finished stages, and a subset of stages reuses earlier outputs."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import saved
import suite_cli
from mopd_jax.evaluation import report


def _run_cli(workdir, *extra):
  """The real entry point (the tiny run's command) in a fresh process with one CPU device."""
  return subprocess.run([*suite_cli.TINY_CLI, "--workdir", workdir, *extra],
                        cwd=suite_cli.ROOT, env=suite_cli.env(), capture_output=True, text=True,
                        timeout=600)


def _copy_without(workdir, wd, stages) -> None:
  """A copy of the tiny run at `wd` without the outputs of `stages` (to be rerun)."""
  shutil.copytree(workdir, wd)
  for stage in stages:
    shutil.rmtree(os.path.join(wd, stage), ignore_errors=True)


@pytest.fixture(scope="module")
def workdir(tiny_run):
  proc, wd = tiny_run
  assert proc.wait(timeout=900) == 0, open(str(wd) + ".log").read()[-3000:]
  return str(wd)


def test_every_stage_leaves_its_outputs(workdir):
  for stage in ("data", "sft", "rl", "mopd", "eval", "report"):
    assert os.path.exists(os.path.join(workdir, stage, "DONE.json")), stage
  manifest = json.load(open(os.path.join(workdir, "teachers.json")))
  assert len(manifest["teachers"]) == 9
  for name, t in manifest["teachers"].items():
    assert {"domain", "effort", "tau", "step", "parent", "config_hash",
            "eval_validation"} <= set(t), name
    assert t["eval_validation"]["n"] == 4, name  # rl.validation_examples of configs/toy.py:tiny
  assert manifest["teachers"]["gen/high"]["parent"].endswith("teacher_max")
  assert manifest["teachers"]["gen/low"]["parent"].endswith("teacher_high")
  # the toy's phases: policy iteration at max, the budget phases held to pi_SFT
  refs = {n: (t["pmd_reference"], t["lr"], t["tau_kl"]) for n, t in manifest["teachers"].items()}
  assert refs["agt/max"] == ("sampler", 3e-4, 0.5) and refs["cod/low"] == ("sft", 5e-4, 0.2)
  assert {t["sample_from"] for t in manifest["teachers"].values()} == {"both"}


def test_vocab_kl_loss_through_the_stage(workdir, tmp_path):
  """The full toy's loss (`mopd.loss=vocab_kl`; the smoke variants keep eq. 15) through the
  real stage: the exact KL is the loss (>= 0, recorded as `kl_vocab` beside eq. 15's
  sampled-token `kl`), and the eval measures the initialised student's held-out KL beside
  pi_SFT's and the final student's."""
  wd = str(tmp_path / "vocab_kl")
  _copy_without(workdir, wd, ("mopd", "eval", "report"))
  proc = _run_cli(wd, "--config.stages=mopd,eval,report", "--config.mopd.loss=vocab_kl",
                  "--config.mopd.length_groups=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  hist = json.load(open(os.path.join(wd, "mopd", "history.json")))
  assert len(hist) == 3 and all(h["loss"] >= 0 and h["kl_vocab"] >= 0 and h["num_rows"] == 9
                                for h in hist)  # the tiny run's 3 steps
  held = json.load(open(os.path.join(wd, "eval.json")))["kl_heldout"]
  assert set(held) == {"sft", "init", "student"}
  assert all(h["tail"]["max"] >= h["tail"]["p50"] for h in held.values())
  rep = json.load(open(os.path.join(wd, "report.json")))
  names = {c["name"] for c in rep["checks"]}
  assert {report.INIT_DROP_CHECK, report.ON_POLICY_DROP_CHECK, report.RISING_CHECK} <= names


def test_soft_target_init_through_the_stage(workdir, tmp_path):
  """`mopd.init_target=distribution` through the real stage: the teacher-SFT init fits the
  teachers' whole next-token distributions (the init's `forward_kl` loss), so its student
  differs from the token-SFT init's of the same pool and updates, and MOPD starts from it."""
  wd = str(tmp_path / "soft")
  _copy_without(workdir, wd, ("mopd", "eval", "report"))
  proc = _run_cli(wd, "--config.stages=mopd", "--config.mopd.init_target=distribution",
                  "--config.mopd.steps=1")
  assert proc.returncode == 0, proc.stderr[-3000:]
  soft = saved.arrays(os.path.join(wd, "mopd", "init_params"))
  hard = saved.arrays(os.path.join(workdir, "mopd", "init_params"))
  assert soft.keys() == hard.keys()
  assert any(not np.array_equal(soft[k], hard[k]) for k in soft)
  assert all(np.isfinite(v).all() for v in soft.values())
  assert len(json.load(open(os.path.join(wd, "mopd", "history.json")))) == 1


def test_the_student_starts_as_pi_sft_at_its_start_temperature(workdir, tmp_path):
  """`mopd.start_temperature`: the stage's student starts as pi_SFT with its final norm scale
  divided by it (its logits divided, `models.with_temperature`) and every other weight as
  pi_SFT's; one step at a rate of 1e-12 leaves that start in the saved student."""
  wd = str(tmp_path / "start_t")
  _copy_without(workdir, wd, ("mopd", "eval", "report"))
  proc = _run_cli(wd, "--config.stages=mopd", "--config.mopd.init=sft",
                  "--config.mopd.start_temperature=0.25", "--config.mopd.steps=1",
                  "--config.mopd.lr=1e-12")
  assert proc.returncode == 0, proc.stderr[-3000:]
  sft = saved.arrays(os.path.join(wd, "sft", "params"))
  student = saved.arrays(os.path.join(wd, "mopd", "params"))
  assert student.keys() == sft.keys()
  scale = [k for k in sft if "final_norm" in k]
  assert len(scale) == 1
  np.testing.assert_allclose(student[scale[0]], sft[scale[0]] / 0.25, rtol=1e-6)
  assert not np.allclose(student[scale[0]], sft[scale[0]], rtol=0.5)
  for k in sft.keys() - set(scale):
    np.testing.assert_allclose(student[k], sft[k], atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_mopd_stage_with_an_effort_mix(workdir, tmp_path):
  """mopd.effort_mix through the real stage: cells of varying size, every effort drawn."""
  wd = str(tmp_path / "mix")
  shutil.copytree(workdir, wd)
  shutil.rmtree(os.path.join(wd, "mopd"))
  proc = _run_cli(wd, "--config.stages=mopd", "--config.mopd.prompts_across_efforts=distinct",
                  "--config.mopd.prompts_per_cell=2", "--config.mopd.effort_mix=(1.,1.,2.)")
  assert proc.returncode == 0, proc.stderr[-3000:]
  hist = json.load(open(os.path.join(wd, "mopd", "history.json")))
  assert len(hist) == 3 and all(h["num_rows"] == 18 for h in hist)  # 3 domains x 6 prompts
  sizes = [sum(1 for n in h["cells"] if n.endswith("/max")) for h in hist]
  assert max(sizes) >= 2  # max (weight 2) drawn in at least two domains in some step


def test_report_schema(workdir):
  rep = json.load(open(os.path.join(workdir, "report.json")))
  policies = {(c["policy"], c["domain"], c["effort"]) for c in rep["cells"]}
  assert len(policies) == 27  # sft, teacher and student in all 9 cells
  for c in rep["cells"]:
    assert {"accuracy", "mean_length", "over_budget_rate", "n"} <= set(c)
    assert 0.0 <= c["accuracy"] <= 1.0
  assert rep["kl"]["initial"] is not None and len(rep["kl"]["curve"]) == 3
  # The exact full-vocabulary KL, every step of the tiny run, overall and per cell: >= 0.
  assert len(rep["kl_exact_curve"]) == 3 and all(v >= 0 for _, v in rep["kl_exact_curve"])
  assert len(rep["kl_exact_per_cell"]) == 9
  # The teacher-SFT init: pi_SFT's exact KL before it, where the KL drop starts.
  assert rep["kl_start"]["policy"] == "sft" and rep["kl_start"]["kl_exact"] >= 0
  assert len(rep["kl_start"]["cells"]) == 9
  assert "Exact per-token KL" in open(os.path.join(workdir, "report.md")).read()
  assert "total" in rep["wall_seconds"] and rep["config"]["seed"] == 0
  for png in ("cells.png", "kl.png", "length.png"):
    assert os.path.getsize(os.path.join(workdir, png)) > 1000
  # 37 + the held-out init's drop, on-policy drop and rising cells + the two wall rows
  assert len(rep["checks"]) == 42 and all(c["ok"] in (True, False) for c in rep["checks"])
  assert rep["grid"]["domains"] == ["gen", "agt", "cod"]
  assert "Expected results of the toy run" in open(
      os.path.join(workdir, "report.md")).read()


def test_eval_scores_the_policies_with_their_teachers(workdir, tmp_path):
  """`eval.teacher_logratio`: pi_SFT's and the student's held-out log-ratio to each cell's
  teacher (in process here; through the servers in the slow served test) beside the same
  accuracies and lengths, and its table in report.md."""
  wd = str(tmp_path / "scored")
  shutil.copytree(workdir, wd)
  for stage in ("eval", "report"):
    os.remove(os.path.join(wd, stage, "DONE.json"))
  proc = _run_cli(wd, "--config.stages=eval,report", "--config.eval.teacher_logratio=True")
  assert proc.returncode == 0, proc.stderr[-3000:]
  plain = json.load(open(os.path.join(workdir, "eval.json")))["cells"]
  scored = json.load(open(os.path.join(wd, "eval.json")))["cells"]
  assert len(plain) == len(scored)
  for a, b in zip(plain, scored):
    assert {k: v for k, v in b.items() if not k.startswith("teacher_logratio")} == a
    if b["policy"] == "teacher":
      assert "teacher_logratio" not in b
    else:
      assert np.isfinite(b["teacher_logratio"]) and b["teacher_logratio_se"] >= 0, b
  assert "log pi - log pi_teacher" in open(os.path.join(wd, "report.md")).read()


def test_rerun_skips_finished_stages(workdir):
  proc = _run_cli(workdir)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.count("already done") == 6


@pytest.mark.slow
def test_mopd_stage_with_asynchronous_teacher_scoring(workdir, tmp_path):
  """mopd.staleness=1 (and 3 microbatches) through the real stage: the same steps,
  importance-weighted, with the first (not yet stale) step equal to the synchronous run's.
  The finished teacher-SFT initialisation is kept (its batch of 16 rows does not split into
  3 microbatches), so both runs start from the same student."""
  wd = str(tmp_path / "async")
  shutil.copytree(workdir, wd)
  for name in os.listdir(os.path.join(wd, "mopd")):
    path = os.path.join(wd, "mopd", name)
    if name == "init_ckpt":
      continue
    if os.path.isdir(path):
      shutil.rmtree(path)
    else:
      os.remove(path)
  proc = _run_cli(wd, "--config.stages=mopd", "--config.mopd.staleness=1",
                  "--config.mopd.microbatches=3")
  assert proc.returncode == 0, proc.stderr[-3000:]
  sync = json.load(open(os.path.join(workdir, "mopd", "history.json")))
  stale = json.load(open(os.path.join(wd, "mopd", "history.json")))
  assert len(stale) == len(sync) == 3
  assert all("is_weight_mean" in h for h in stale) and "is_weight_mean" not in sync[0]
  # Step 0 trains on a batch its own params sampled: weights 1 up to sampler round-off.
  assert stale[0]["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
  assert stale[0]["loss"] == pytest.approx(sync[0]["loss"], rel=1e-3, abs=1e-5)
  done = json.load(open(os.path.join(wd, "mopd", "DONE.json")))
  assert done["staleness"] == 1 and done["phase_seconds_per_step"]["step"] > 0


@pytest.mark.slow
def test_mopd_stage_with_partial_rollouts_resumes_exactly(workdir, tmp_path):
  """mopd.partial_rollout_tokens through the real stage: rows decode 6 tokens a step and
  carry over; only complete rows are trained on (fewer than the step's prompts while rows
  are in flight). Resumed from the checkpoint of step 2 (its in-flight rows with it), step 3
  and the final params are those of the uninterrupted run."""
  wd = str(tmp_path / "partial")
  shutil.copytree(workdir, wd)
  shutil.rmtree(os.path.join(wd, "mopd"))
  args = ("--config.stages=mopd", "--config.mopd.partial_rollout_tokens=6",
          "--config.checkpoint.every=1")
  proc = _run_cli(wd, *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  hist = json.load(open(os.path.join(wd, "mopd", "history.json")))
  assert len(hist) == 3 and all("in_flight" in h for h in hist)
  assert any(h["in_flight"] > 0 for h in hist) and all(h["rows"] >= 1 for h in hist)
  assert json.load(open(os.path.join(wd, "mopd", "DONE.json")))["partial_rollout_tokens"] == 6
  final = saved.arrays(os.path.join(wd, "mopd", "params"))
  for name in ("DONE.json", "history.json"):
    os.remove(os.path.join(wd, "mopd", name))
  shutil.rmtree(os.path.join(wd, "mopd", "params"))
  shutil.rmtree(os.path.join(wd, "mopd", "ckpt", "3"))
  proc = _run_cli(wd, *args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "resuming from checkpoint step 2" in proc.stdout + proc.stderr
  assert json.load(open(os.path.join(wd, "mopd", "history.json"))) == hist
  again = saved.arrays(os.path.join(wd, "mopd", "params"))
  assert again.keys() == final.keys() and final
  assert all(np.array_equal(again[k], final[k]) for k in final)


class _FailingProxy:
  """A loopback proxy to a teacher server that forwards `forward` scoring requests, then
  answers every later one with 503 (a server gone away), or, `perturb`, with the server's
  answer every log-prob of which is lowered by `perturb` nats (a teacher that drifted);
  other requests always pass."""

  def __init__(self, target: str, forward: int, perturb: float = 0.0):
    import http.server
    import threading
    import urllib.error
    import urllib.request
    count, lock = [0], threading.Lock()

    class H(http.server.BaseHTTPRequestHandler):
      def log_message(self, *a):
        pass

      def relay(self, body=None):
        if body is not None and self.path == "/v1/completions":
          with lock:
            count[0] += 1
            late = count[0] > forward
          if late and not perturb:
            return self.answer(503, b'{"object": "error", "message": "gone", "code": 503}')
        else:
          late = False
        req = urllib.request.Request(target + self.path, data=body,
                                     headers={"Content-Type": "application/json"})
        try:
          with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
            if late:
              answer = json.loads(data)
              for choice in answer["choices"]:
                for entry in choice["prompt_logprobs"][1:]:
                  for v in entry.values():
                    v["logprob"] -= perturb
              data = json.dumps(answer).encode()
            self.answer(r.status, data)
        except urllib.error.HTTPError as e:
          self.answer(e.code, e.read())

      def answer(self, status, data):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def do_GET(self):
        self.relay()

      def do_POST(self):
        self.relay(self.rfile.read(int(self.headers["Content-Length"])))

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def _assert_eval_logratios_match(src: str, tmp_path, endpoints_flag: str) -> None:
  """The eval stage rerun on `src`'s outputs in process and through the servers that
  `endpoints_flag` names: each cell's teacher log-ratio equal to 1e-4."""
  ratios = {}
  for name, extra in (("local", ()), ("served", (endpoints_flag,))):
    ev = str(tmp_path / f"eval_{name}")
    shutil.copytree(src, ev)
    os.remove(os.path.join(ev, "eval", "DONE.json"))
    proc = _run_cli(ev, "--config.stages=eval", "--config.eval.teacher_logratio=True", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios[name] = [c.get("teacher_logratio") for c in
                    json.load(open(os.path.join(ev, "eval.json")))["cells"]]
  assert any(r is not None for r in ratios["local"])
  for a, b in zip(ratios["local"], ratios["served"]):
    assert (a is None and b is None) or a == pytest.approx(b, abs=1e-4), (a, b)


@pytest.mark.slow
def test_mopd_stage_scored_by_a_teacher_server(workdir, tmp_path):
  """`teacher.endpoints` through the real stage: a server started from the run's own
  teachers.json (loopback) scores every step; staleness 0 follows the co-located run's
  history to float rounding (the server's log-probs agree within 1e-5, not bitwise) and
  staleness 1 runs. A run whose server goes away stops after a checkpoint, and the same
  command, the server back, finishes with bitwise the uninterrupted served run's history
  and student (the server's scoring is batch-invariant)."""
  import sys
  server = subprocess.Popen(
      [sys.executable, "-m", "mopd_jax.serve", "--config", "configs/toy.py:tiny",
       "--teachers", os.path.join(workdir, "teachers.json"), "--port", "0"],
      cwd=suite_cli.ROOT, env=suite_cli.env(), stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  try:
    line = server.stdout.readline()
    while line and "listening on" not in line:
      line = server.stdout.readline()
    url = line.split("listening on")[1].strip()
    manifest = json.load(open(os.path.join(workdir, "teachers.json")))
    endpoints = ",".join(f"{cell}={url}" for cell in manifest["teachers"])
    sync = json.load(open(os.path.join(workdir, "mopd", "history.json")))
    runs = {}
    for staleness in (0, 1):
      wd = str(tmp_path / f"served{staleness}")
      shutil.copytree(workdir, wd)
      shutil.rmtree(os.path.join(wd, "mopd"))
      proc = _run_cli(wd, "--config.stages=mopd", f"--config.teacher.endpoints={endpoints}",
                      f"--config.mopd.staleness={staleness}")
      assert proc.returncode == 0, proc.stderr[-3000:]
      served = runs[staleness] = json.load(open(os.path.join(wd, "mopd", "history.json")))
      assert len(served) == len(sync) == 3
      # The parity probe ran at start (the run holds the teachers for its init): every cell's
      # server scores within float rounding of the in-process teacher.
      gaps = json.load(open(os.path.join(wd, "teacher_parity.json")))["gaps"]
      assert set(gaps) == set(manifest["teachers"]) and max(gaps.values()) < 1e-4, gaps
      if staleness == 0:
        for a, b in zip(served, sync):
          for key in ("loss", "kl", "accuracy", "length"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), (key, a, b)
      else:
        assert all("is_weight_mean" in h for h in served)
    # The server goes away after the start-up check's 9 scoring requests (one per cell), the
    # parity probe's 36 (4 rows of each of 9 cells) and step 0's 9: the run stops with step 1
    # saved (checkpoints otherwise every 10 steps), and the same command, the server back,
    # resumes.
    wd = str(tmp_path / "interrupted")
    shutil.copytree(workdir, wd)
    shutil.rmtree(os.path.join(wd, "mopd"))
    proxy = _FailingProxy(url, forward=9 + 36 + 9)
    cut = ",".join(f"{cell}={proxy.url}" for cell in manifest["teachers"])
    args = ("--config.stages=mopd", "--config.checkpoint.every=10",
            "--config.teacher.endpoint_retries=1")
    try:
      proc = _run_cli(wd, *args, f"--config.teacher.endpoints={cut}")
    finally:
      proxy.close()
    lines = [x for x in proc.stderr.splitlines() if x.startswith("teacher error:")]
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr[-3000:]
    assert proxy.url in lines[0] and "last checkpoint: step 1" in lines[0], lines[0]
    proc = _run_cli(wd, *args, f"--config.teacher.endpoints={endpoints}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from checkpoint step 1" in proc.stdout + proc.stderr
    # A teacher whose log-probs drift mid-run is caught at the next probe (one every step
    # here): the start-up check's 9, the probe's 36, step 0's 9, the probe after it, step
    # 1's 9 pass; the probe after step 1 sees every log-prob 0.5 nats lower.
    drift = str(tmp_path / "drift")
    shutil.copytree(workdir, drift)
    shutil.rmtree(os.path.join(drift, "mopd"))
    proxy = _FailingProxy(url, forward=9 + 36 + 9 + 36 + 9, perturb=0.5)
    drifting = ",".join(f"{cell}={proxy.url}" for cell in manifest["teachers"])
    try:
      proc = _run_cli(drift, *args, f"--config.teacher.endpoints={drifting}",
                      "--config.teacher.probe_every=1")
    finally:
      proxy.close()
    lines = [x for x in proc.stderr.splitlines() if x.startswith("teacher error:")]
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr[-3000:]
    assert ("after step 1 (steps 1-1 trained on these scores), teacher parity probe" in lines[0]
            and "last checkpoint: step 2" in lines[0]), lines[0]
    resumed = json.load(open(os.path.join(wd, "mopd", "history.json")))
    assert resumed == runs[0]  # bitwise: every float of every step
    served0 = saved.arrays(tmp_path / "served0" / "mopd" / "params")
    for key, value in saved.arrays(os.path.join(wd, "mopd", "params")).items():
      np.testing.assert_array_equal(value, served0[key], err_msg=key)
    # The eval stage scores pi_SFT's and the student's answers through the same servers: the
    # log-ratios equal the in-process eval's to float rounding.
    _assert_eval_logratios_match(wd, tmp_path, f"--config.teacher.endpoints={endpoints}")
    # A server that is not there: one `teacher error:` line naming a cell and the URL, exit 3.
    server.terminate()
    assert server.wait(timeout=60) == 0
    shutil.rmtree(os.path.join(tmp_path, "served0", "mopd"))
    proc = _run_cli(str(tmp_path / "served0"), "--config.stages=mopd",
                    "--config.teacher.endpoint_retries=1",
                    f"--config.teacher.endpoints={endpoints}")
    lines = [x for x in proc.stderr.splitlines() if x.startswith("teacher error:")]
    assert proc.returncode == 3 and len(lines) == 1 and url in lines[0], proc.stderr[-3000:]
  finally:
    server.terminate()
    assert server.wait(timeout=60) == 0


@pytest.mark.slow
def test_mopd_stage_scored_by_vllm_and_sglang_stand_ins(workdir, tmp_path):
  """The teachers exported for the engines (`python -m mopd_jax.serve --export_dir`, the
  scoring temperature folded into the weights) and served by the faithful vLLM and SGLang
  stand-ins launched with the docs' command lines (raw-logit prompt log-probs, no
  tokenizer): the start-up checks and the parity probe pass, the MOPD stage follows the
  co-located run's history to float rounding, and the eval stage scores the run's policies
  through them as the co-located eval does (its teacher log-ratios to float rounding)."""
  import sys
  export = str(tmp_path / "export")
  proc = subprocess.run(
      [sys.executable, "-m", "mopd_jax.serve", "--config", "configs/toy.py:tiny",
       "--teachers", os.path.join(workdir, "teachers.json"), "--export_dir", export],
      cwd=suite_cli.ROOT, env=suite_cli.env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  launch = [x.split() for x in proc.stdout.splitlines() if x.startswith("vllm serve ")]
  manifest = json.load(open(os.path.join(workdir, "teachers.json")))
  assert len(launch) == len(manifest["teachers"])
  servers, endpoints = [], {}
  try:
    for i, line in enumerate(launch):  # the last cell on SGLang, the others on vLLM
      path, cell = line[2], line[line.index("--served-model-name") + 1]
      args = (["vllm"] + line[1:-2] if i < len(launch) - 1 else
              ["sglang", "--model-path", path, "--served-model-name", cell])
      servers.append(subprocess.Popen(
          [sys.executable, "tests/engine_standins.py", *args, "--port", "0"],
          cwd=suite_cli.ROOT, env=suite_cli.env(), stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True))
      out = servers[-1].stdout.readline()
      while out and "listening on" not in out:
        out = servers[-1].stdout.readline()
      endpoints[cell] = out.split("listening on")[1].strip()
    wd = str(tmp_path / "engines")
    shutil.copytree(workdir, wd)
    shutil.rmtree(os.path.join(wd, "mopd"))
    served = "--config.teacher.endpoints=" + ",".join(f"{c}={u}" for c, u in endpoints.items())
    proc = _run_cli(wd, "--config.stages=mopd", served)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_eval_logratios_match(workdir, tmp_path, served)
  finally:
    for srv in servers:
      srv.kill()
  gaps = json.load(open(os.path.join(wd, "teacher_parity.json")))["gaps"]
  assert set(gaps) == set(manifest["teachers"]) and max(gaps.values()) < 1e-4, gaps
  sync = json.load(open(os.path.join(workdir, "mopd", "history.json")))
  served = json.load(open(os.path.join(wd, "mopd", "history.json")))
  assert len(served) == len(sync)
  for a, b in zip(served, sync):
    for key in ("loss", "kl", "accuracy", "length"):
      assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), (key, a, b)


def test_unknown_stage_is_an_error(workdir):
  proc = _run_cli(workdir, "--config.stages=sft,distill")
  assert proc.returncode == 2 and "config error: unknown stage(s) ['distill']" in proc.stderr
  assert "Traceback" not in proc.stderr


def _run_experiment(name: str, workdir, *args):
  """`python -m experiments.<name>` with the tiny run's config and overrides on its
  workdir; the finished process (asserted to exit 0)."""
  python, _, _, *config = suite_cli.TINY_CLI  # the tiny run's config and overrides
  proc = subprocess.run([python, "-m", f"experiments.{name}", *config, "--workdir", workdir,
                         *args], cwd=suite_cli.ROOT, env=suite_cli.env(), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_style_mix_counts_every_sampled_response(workdir, tmp_path):
  """`python -m experiments.style_mix` on the tiny run's pi_SFT: every sampled response
  lands in one style, with its accuracy and length; the first character names the style."""
  from experiments import style_mix
  assert [style_mix.style_of(t) for t in ("~1,2\n#0", "#3", "1,0\n#1")] == [
      "brief", "direct", "full"]
  out = tmp_path / "mix.json"
  proc = _run_experiment("style_mix", workdir, "--samples=6", f"--out={out}")
  mix = json.load(open(out))["mix"]
  assert list(mix) == ["gen", "agt", "cod"]
  for domain, styles in mix.items():
    assert sum(s["n"] for s in styles.values()) == 6, domain
    assert set(styles) <= {"full", "brief", "direct"}
    assert all(0.0 <= s["accuracy"] <= 1.0 and s["mean_length"] > 0 for s in styles.values())
  assert "accuracy" in proc.stdout


def test_mopd_noise_measures_eq15_against_its_expectation(workdir, tmp_path):
  """`python -m experiments.mopd_noise` on the tiny run's initialised student: cosines in
  [-1, 1], tail shares in [0, 1], and the per-rollout KL quantiles in order."""
  out = tmp_path / "noise.json"
  _run_experiment("mopd_noise", workdir, "--batches=2", f"--out={out}")
  s = json.load(open(out))["summary"]
  for key in ("cos_eq15_vocab", "cos_eq15_pairs", "cos_vocab_pairs"):
    assert -1.0 <= s[key]["mean"] <= 1.0, (key, s[key])
  for key in ("tail_share_eq15", "tail_share_vocab", "tail_share_kl"):
    assert 0.0 <= s[key]["mean"] <= 1.0 + 1e-6, (key, s[key])
  q = s["row_kl_quantiles"]
  assert q["0.5"] <= q["0.9"] <= q["0.99"] <= q["1.0"]


def test_kl_tail_ranks_the_held_out_rollouts(workdir, tmp_path):
  """`python -m experiments.kl_tail` on the tiny run's final student: the rollouts ranked by
  their mean exact KL, each the mean of its tokens' KL, the token mean over all of them
  the one printed, and the top 1%'s cells among the grid's."""
  out = tmp_path / "tail.json"
  proc = _run_experiment("kl_tail", workdir, "--prompts=2", "--top=3", f"--out={out}")
  t = json.load(open(out))
  means = [r["mean_kl"] for r in t["ranked"]]
  assert means == sorted(means, reverse=True) and len(means) == t["rollouts"] > 0
  for r in t["ranked"]:
    assert np.isclose(r["mean_kl"], np.mean([k for _, k in r["tokens"]]), rtol=1e-5, atol=1e-7)
  total = sum(k for r in t["ranked"] for _, k in r["tokens"])
  assert np.isclose(t["kl_exact"], total / sum(len(r["tokens"]) for r in t["ranked"]))
  assert set(t["top1pct_cells"]) <= {r["cell"] for r in t["ranked"]}
  assert f"{t['kl_exact']:.4f}" in proc.stdout
  assert set(t["onsets"]) == {r["cell"] for r in t["ranked"]}
  assert "response positions with the largest mean KL" in proc.stdout
  # The off-track rollouts: those with a token above --off_track nats, and their KL's share.
  o = t["off_track"]
  off = [r for r in t["ranked"] if max(k for _, k in r["tokens"]) > 5.0]
  assert o["rollouts"] == len(off) == sum(o["cells"].values())
  assert o["lengths"] == sorted(len(r["tokens"]) for r in off) and 0.0 <= o["share"] <= 1.0
  assert np.isclose(o["share"] * total, sum(k for r in off for _, k in r["tokens"]))
  assert "rollouts with a token above 5.0 nats" in proc.stdout
  # --temperature divides the policy's logits: another policy, another KL; 1 is the policy.
  sharp = tmp_path / "sharp.json"
  _run_experiment("kl_tail", workdir, "--prompts=2", "--top=0", "--temperature=0.5",
                  "--off_track=0.001", f"--out={sharp}")
  s = json.load(open(sharp))
  assert s["kl_exact"] != t["kl_exact"]
  # A threshold the tiny student's rollouts cross: the rows above it, and no others, counted.
  off = [r for r in s["ranked"] if max(k for _, k in r["tokens"]) > 0.001]
  assert 0 < s["off_track"]["rollouts"] == len(off)
  assert s["off_track"]["lengths"] == sorted(len(r["tokens"]) for r in off)


def test_clip_share_splits_the_kl_gradient_by_cell(workdir, tmp_path):
  """`python -m experiments.clip_share` on the tiny run's pi_SFT: every cell of the grid,
  shares in [0, 1], the cells' shares of the gradient summing to 1 with and without the
  clip, the tokens adding up to "all"; a tiny `--config.mopd.r_max` puts more of the
  gradient beyond the clip than a huge one, which puts none there."""
  out, wide, tight = (tmp_path / f for f in ("shares.json", "wide.json", "tight.json"))
  _run_experiment("clip_share", workdir, "--prompts=2", f"--out={out}")
  s = json.load(open(out))
  cells = {k: v for k, v in s.items() if k != "all"}
  assert len(cells) == 9 and sum(v["tokens"] for v in cells.values()) == s["all"]["tokens"] > 0
  for key in ("cell_share", "cell_share_clipped"):
    assert np.isclose(sum(v[key] for v in cells.values()), 1.0, atol=1e-6)
  assert all(0.0 <= v["beyond"] <= 1.0 for v in s.values())
  _run_experiment("clip_share", workdir, "--prompts=2", "--config.mopd.r_max=1e4",
                  f"--out={wide}")
  _run_experiment("clip_share", workdir, "--prompts=2", "--config.mopd.r_max=0.01",
                  f"--out={tight}")
  w, t = json.load(open(wide))["all"], json.load(open(tight))["all"]
  assert w["beyond"] == 0.0 and np.isclose(w["clip_over_kl"], 1.0, rtol=1e-4)
  assert t["beyond"] > 0.5 and not np.isclose(t["clip_over_kl"], 1.0, rtol=1e-2)


def test_greedy_parts_finds_where_the_greedy_answers_part(workdir, tmp_path):
  """`python -m experiments.greedy_parts` on the tiny run's `gen/high`: the greedy
  accuracies are the eval stage's for the cell (the same prompts, engine and key), every
  parted prompt has one parting position, and each policy's margin for its own token there
  is >= 0 (greedy took its argmax after the very prefix it decoded, so the parting position
  is the first differing token). In a subprocess, as every experiment's flags are global."""
  out = tmp_path / "parts.json"
  _run_experiment("greedy_parts", workdir, "--cell=gen/high", "--examples=4", "--by=char",
                  f"--out={out}")
  g = json.load(open(out))
  cells = json.load(open(os.path.join(workdir, "eval.json")))["cells"]
  for policy in ("student", "teacher"):
    (acc,) = [c["accuracy"] for c in cells
              if (c["policy"], c["domain"], c["effort"]) == (policy, "gen", "high")]
    assert g["accuracy"][policy] == acc
  assert 0 < g["parted"] <= 4 and sum(g["positions"].values()) == g["parted"]
  assert all(q[0] >= -1e-4 for q in g["margin_quantiles"].values())
  # The teacher's margin read by characters (`char_marginal`, as for a teacher of another
  # tokenizer) equals its token margin when the teacher writes one token per character.
  assert g["teacher_margin_by"] == "char"
  np.testing.assert_allclose(g["margin_quantiles"]["teacher"],
                             g["margin_quantiles"]["teacher_by_token"], atol=1e-4)


_CACHE_CHILD = r"""
import os, sys
import jax, jax.numpy as jnp
from mopd_jax import pipeline
got = pipeline.use_compile_cache("{workdir}/xla", sys.argv[1])
jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()
print("CACHE", got, os.environ["JAX_COMPILATION_CACHE_DIR"])
# A second run in the same process (a notebook) gets its own directory.
second = pipeline.use_compile_cache("{workdir}/xla", sys.argv[1] + "/second")
jax.jit(lambda x: jnp.cos(x) * 5)(jnp.ones(9)).block_until_ready()
print("SECOND", second, sorted(os.listdir(second)) != [])
"""


def test_compile_cache_goes_under_the_workdir_and_to_child_processes(tmp_path):
  """`compile_cache`: the run's programs land in the directory (`{workdir}` replaced), which
  the environment passes on to the lanes; a JAX_COMPILATION_CACHE_DIR already set wins."""
  env = {k: v for k, v in suite_cli.env().items() if not k.startswith("JAX_PERSISTENT")
         and k != "JAX_COMPILATION_CACHE_DIR"}
  out = subprocess.run([sys.executable, "-c", _CACHE_CHILD, str(tmp_path)], cwd=suite_cli.ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  want = str(tmp_path / "xla")
  assert f"CACHE {want} {want}" in out.stdout
  assert os.listdir(want)  # the jitted program, although it compiled in milliseconds
  assert f"SECOND {tmp_path / 'second' / 'xla'} True" in out.stdout
  mine = str(tmp_path / "mine")
  out = subprocess.run([sys.executable, "-c", _CACHE_CHILD, str(tmp_path)], cwd=suite_cli.ROOT,
                       env=dict(env, JAX_COMPILATION_CACHE_DIR=mine), capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and f"CACHE {mine} {mine}" in out.stdout, out.stderr[-2000:]


def test_teacher_parity_measures_each_source_against_the_run(workdir):
  """`python -m experiments.teacher_parity` on the tiny run's teachers: the loopback server
  scores within float rounding; temperature 1, rotated cells and a uniform teacher stand
  well apart from it."""
  out = _run_experiment("teacher_parity", workdir, "--rows=2").stdout
  rows = {line.split("|")[1].strip(): float(line.split("|")[2])
          for line in out.splitlines() if line.startswith("| ") and "source" not in line}
  assert len(rows) == 5, out
  server = rows.pop("server, same params and temperature")
  bf16 = rows.pop("the same teachers in bfloat16 (params and compute)")
  assert server < 1e-4 and all(v > 100 * max(server, 1e-6) for v in rows.values()), out
  assert server < bf16 < min(rows.values()), out  # bfloat16 rounding: between the two
