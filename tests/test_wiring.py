"""The stages' inputs: built by plain functions from the RunConfig and collaborators
(`stages/sources.py`), never holding the run context or a method of it; a stage runs from
inputs a test builds itself, without a `Run`."""
import dataclasses
import json
import types

import jax
import pytest

from configs import toy
from mopd_jax import configure
from mopd_jax.io import hf
from mopd_jax.io.tokenizer import load_tokenizer
from mopd_jax.stages import context, smoke, sources, wiring
from mopd_jax.teachers import placement


def _holds_the_run(value, run, depth: int = 0) -> bool:
  """Whether `value` is the run, a bound method of it, or a function closing over it (looked
  into containers and frozen dataclasses a few levels deep)."""
  if value is run or depth > 3:
    return value is run
  if isinstance(value, types.MethodType):
    return value.__self__ is run
  if isinstance(value, types.FunctionType):
    cells = [c.cell_contents for c in (value.__closure__ or ())]
    return any(_holds_the_run(c, run, depth + 1) for c in cells)
  if isinstance(value, dict):
    return any(_holds_the_run(v, run, depth + 1) for v in value.values())
  if isinstance(value, (list, tuple)):
    return any(_holds_the_run(v, run, depth + 1) for v in value)
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return any(_holds_the_run(getattr(value, f.name), run, depth + 1)
               for f in dataclasses.fields(value))
  return False


def test_the_check_can_fail():
  run = object()
  holder = types.SimpleNamespace(f=lambda: run)
  assert _holds_the_run(holder.f, run) and _holds_the_run({"a": [run]}, run)
  assert not _holds_the_run(lambda: 1, run)


@pytest.fixture(scope="module")
def tiny_workdir(tiny_run):
  proc, wd = tiny_run
  assert proc.wait(timeout=900) == 0, open(str(wd) + ".log").read()[-3000:]
  return str(wd)


@pytest.mark.parametrize("stage", wiring.STAGES)
def test_no_stage_input_holds_the_run(stage, tiny_workdir):
  """Every stage's inputs, built by the wiring from a run on the tiny run's workdir (its
  teachers and data), hold collaborators and values, never the run or its methods."""
  c = toy.get_config("tiny")
  c.mopd.steps = 3
  c.mesh.data = jax.device_count()  # the suite's simulated devices
  c.mopd.prompts_per_cell = jax.device_count()  # the MOPD batch splits over them
  run = context.Run(configure.build(c, jax.device_count()), tiny_workdir)
  inp = getattr(wiring, f"{stage}_inputs")(run)
  held = [f.name for f in dataclasses.fields(inp) if _holds_the_run(getattr(inp, f.name), run)]
  assert not held, f"{stage}'s inputs hold the run through {held}"


def test_a_stage_runs_from_inputs_built_without_the_run():
  """The smoke stage from its own `Inputs`, built here from the RunConfig, a tokenizer and
  the `Policies` collaborator: no run context anywhere."""
  c = toy.get_config("tiny")
  c.mesh.data = jax.device_count()  # the suite's simulated devices
  c.mopd.prompts_per_cell = jax.device_count()  # the MOPD batch splits over them
  rc = configure.build(c, jax.device_count())
  tok = load_tokenizer("char", efforts=rc.grid.effort_names, options=rc.tokenizer_options())
  model_cfg = hf.resolve_model_config(rc.model.mapping(), tok.vocab_size)
  mesh, _ = placement.config_meshes(rc)
  inp = smoke.Inputs(cfg=rc.smoke, seed=rc.seed, tok=tok, model_cfg=model_cfg,
                     policies=sources.Policies(rc, model_cfg=model_cfg, mesh=mesh))
  texts = smoke.run(inp)
  assert len(texts) == len(rc.smoke.prompts) and all(isinstance(t, str) for t in texts)


@pytest.mark.parametrize("server_temperature, passes", [(None, True), (1.0, False)])
def test_the_parity_probe_at_start(tiny_workdir, tmp_path, server_temperature, passes):
  """`wiring.parity_probe` on the tiny run's teachers: a loopback server at the run's scoring
  temperature passes and its gaps are recorded; one that scores at temperature 1 (the
  metadata check, which would refuse it first, bypassed: as a vLLM server that ignores the
  request's temperature) is a config error naming the cells."""
  import shutil
  from mopd_jax.config import schema
  from mopd_jax.teachers import client, server
  wd = tmp_path / "wd"
  shutil.copytree(tiny_workdir, wd, ignore=shutil.ignore_patterns("mopd", "eval*", "report*"))
  c = toy.get_config("tiny")
  c.mesh.data = jax.device_count()
  c.mopd.prompts_per_cell = jax.device_count()
  run = context.Run(configure.build(c, jax.device_count()), str(wd))
  bank = run.teachers.load_bank()
  scoring = wiring.scoring_bank(run, bank)
  temp = server_temperature or c.mopd.teacher_temperature
  srv = server.TeacherServer(bank, run.tok, temperature=temp)
  srv.start()
  scorer = client.EndpointScorer(run.grid.names, {n: srv.url for n in run.grid.names})
  try:
    from mopd_jax.io import tokenizer
    scorer.check(vocab_size=run.model_cfg.vocab_size,
                 tokenizer_hash=tokenizer.fingerprint(run.tok))  # temperature not compared
    if passes:
      monitor = wiring.parity_probe(run, scoring, scorer)
      written = json.loads((wd / "teacher_parity.json").read_text())
      gaps = written["gaps"]
      assert set(gaps) == set(run.grid.names) and max(gaps.values()) < 1e-4
      assert written["against"] == "the run's own teachers"
      assert monitor.every == c.teacher.probe_every and monitor.measure(scorer) == gaps
    else:
      with pytest.raises(schema.ConfigError, match=r"teacher parity probe: .* nats per token"):
        wiring.parity_probe(run, scoring, scorer)
  finally:
    scorer.close()
    srv.stop()
