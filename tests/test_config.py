"""Config validation: clear errors before compilation, also under `python -O`."""
import json
import os
import subprocess
import sys

import pytest
import suite_cli
from experiments import ablate
from mopd_jax import configure

ROOT = suite_cli.ROOT

# Every cell of the toy grid brought as a checkpoint (the paths are not read at config time).
_HF_ALL = ("c.teacher.hf_paths = ','.join(f'{d}/{e}=/t/{d}{e}' for d in ('gen', 'agt', 'cod') "
           "for e in ('low', 'high', 'max'))")

CASES = [
    ("c.mesh.data = 2", "mesh"),
    ("c.effort.high.tau = 1.5", "taus must differ"),
    ("c.effort.low.tau = float('nan')", "tau must be a finite number"),
    ("c.effort.low.tau = -1.0", "tau must be a finite number"),
    ("c.domains = 'gen,math'", "unknown domain"),
    ("c.efforts = 'low,medium'", "unknown effort"),
    ("c.efforts = 'low,low'", "repeats a name"),
    ("c.domains = ''", "names no entry"),
    ("c.tasks.gen.task = 'algebra'", "not a registered task"),
    ("c.mopd.r_max = 0.0", "r_max"),
    ("c.mopd.loss = 'kl'", "mopd.loss"),
    ("c.checkpoint.every = 0", "checkpoint.every"),
    ("c.mopd.staleness = 2", "mopd.staleness"),
    ("c.sft.schedule = 'gen,agt'", "sft.schedule"),
    ("c.sft.schedule = 'gen,agt,cod,math'", "unknown: ['math']"),
    ("c.tasks.x = {'task': 'gen'}; c.domains = 'gen,agt,cod,x'", "must name every domain"),
    ("c.sft.style_weights.agt = (1.0, 2.0)", "one per style"),
    ("c.sft.style_weights.agt = (0.0, 0.0, 0.0)", "not all zero"),
    ("c.sft.style_weights = {'math': (1.0, 1.0, 1.0)}", "unknown domains ['math']"),
    ("c.sft.weight_decay = -0.1", "sft.weight_decay"),
    ("c.mopd.staleness = 1; c.mopd.is_bounds = (1.5, 2.0)", "mopd.is_bounds"),
    ("c.mopd.staleness = 1; c.mopd.loss = 'topk'", "needs mopd.loss='mopd'"),
    ("c.rl.reference = 'teacher'", "rl.reference"),
    ("c.mopd.teacher_temperature = 0.0", "mopd.teacher_temperature"),
    ("c.mopd.start_temperature = -0.5", "mopd.start_temperature"),
    ("c.rl.loss = 'grpo'", "needs rl.loss='pmd'"),  # the toy's high and low hold pi_SFT
    ("c.rl.reference = 'sampler,sft,sft,sft'", "one per phase"),
    ("c.rl.reference = 'phase'", "rl.reference"),
    ("c.rl.anneal_tau_kl = -1.0", "rl.anneal_tau_kl must be a finite number >= 0"),
    ("c.sft.steps = -1", "sft.steps must be an int >= 0, got -1"),
    ("c.sft.steps = 0; c.teacher.outside_cell = 'gen/max'", "it needs sft.steps > 0"),
    ("c.teacher.hf_paths = 'gen/low=/a'", "missing ['gen/high'"),
    ("c.teacher.hf_paths = 'gen/low=/a,gen/low=/b'", "names cell 'gen/low' twice"),
    ("c.teacher.hf_paths = 'gen/low'", "is not 'domain/effort=directory'"),
    ("c.teacher.hf_paths = ','.join(f'{d}/{e}=/x' for d in ('gen', 'agt', 'cod') "
     "for e in ('low', 'high', 'max')) + ',gen/mid=/y'", "not cells of the grid: ['gen/mid']"),
    ("c.teacher.endpoints = 'gen/low=http://127.0.0.1:1'", "teacher.endpoints must map every "
     "cell of the grid"),
    ("c.teacher.endpoints = 'gen/low=ftp://a'", "must be http(s) URLs"),
    ("c.teacher.endpoints = 'gen/low'", "is not 'domain/effort=URL[|URL...]'"),
    ("c.teacher.endpoint_timeout_s = 0.0", "teacher.endpoint_timeout_s must be a finite number"),
    ("c.teacher.endpoint_retries = -1", "teacher.endpoint_retries must be an int >= 0"),
    ("c.tasks.gen.train = 'x.jsonl'", "tasks.gen has field(s) ['train']; a domain of task "
     "'gen' takes only 'task'"),
    ("c.tasks.gen.task = 'records'", "tasks.gen lacks"),
    ("c.tasks.gen = dict(task='records', train='a.jsonl', test='b.jsonl', verifier='maths', "
     "validation=4)", "tasks.gen.verifier='maths'; registered verifiers"),
    ("c.prompt.effort_format = 'system'", "needs a Hugging Face tokenizer"),
    ("c.prompt.effort_format = 'text'", "prompt.effort_format='text'"),
    ("c.data.on_too_long = 'truncate'", "data.on_too_long='truncate'"),
    ("c.budget.source = 'guess'", "budget.source='guess'"),
    ("c.budget.samples = 0", "budget.samples must be an int >= 1"),
    ("c.mopd.exact_kl_every = -1", "mopd.exact_kl_every must be an int >= 0"),
    ("c.rl.validation_examples = -1", "rl.validation_examples must be an int >= 0"),
    ("c.rollout.sampling_dtype = 'float16'", "rollout.sampling_dtype='float16'"),
    ("c.rollout.decode_slots = -1", "rollout.decode_slots must be an int >= 0"),
    ("c.rollout.admission = 'random'", "rollout.admission='random'"),
    ("c.mopd.partial_rollout_tokens = -4", "mopd.partial_rollout_tokens must be an int >= 0"),
    ("c.rl.partial_mode = 'reuse'", "rl.partial_mode='reuse'"),
    ("c.mopd.loss = 'mopd'; c.mopd.partial_rollout_tokens = 8; c.mopd.staleness = 1",
     "needs mopd.staleness=0"),
    ("c.mopd.partial_rollout_tokens = 8; c.mopd.partial_mode = 'importance'; "
     "c.mopd.loss = 'pg'", "mopd.partial_mode='importance' weights"),
    ("c.mopd.steps = -3", "mopd.steps must be an int >= 1, got -3"),
    ("c.rl.group_size = 0", "rl.group_size must be an int >= 1"),
    ("c.rl.temperature = float('nan')", "rl.temperature must be a finite number >= 0"),
    ("c.eval.temperature = -0.5", "eval.temperature must be a finite number >= 0"),
    ("c.mopd.lr = 0.0", "mopd.lr must be a finite number > 0"),
    ("c.sft.lr = float('inf')", "sft.lr must be a finite number > 0"),
    ("c.rl.tau_kl = -0.5", "rl.tau_kl must be a finite number > 0"),
    ("c.data.sizes = (10, 0, 5)", "data.sizes[1] must be an int >= 1, got 0"),
    ("c.data.sizes = (10, 5)", "data.sizes must have 3 entries"),
    ("c.sft.stepz = 3", "unknown field(s) ['sft.stepz']"),
    ("del c.sft['steps']", "sft lacks ['sft.steps']"),
    ("c.learning_rate = 1e-3", "unknown config field(s) ['learning_rate']"),
    ("c.model.quant = 'int3'", "model.quant='int3'"),
    ("c.model.remat = 'all'", "model.remat='all'"),
    ("c.placement.teachers = 'remote'", "placement.teachers='remote'"),
    ("c.mesh.pipeline = 1", "mesh names unknown mesh axes ['pipeline']"),
    ("c.profile.stage = 'eval'", "profile.stage='eval'"),
    ("c.distributed.num_processes = -1", "distributed.num_processes must be an int >= 0"),
    ("c.sandbox.backend = 'docker'", "sandbox.backend='docker'"),
    ("c.sandbox.workers = 0", "sandbox.workers must be an int >= 1"),
    ("c.sandbox.timeout_s = 900.0", "sandbox.timeout_s must be below 600"),
    ("c.sandbox.memory_mb = 16", "sandbox.memory_mb must be an int >= 64"),
    ("c.sft.effort_mode = 'styled'", "sft.effort_mode='styled'"),
    ("c.mopd.init = 'teacher'", "mopd.init='teacher'"),
    ("c.rollout.max_response_tokens = 0", "rollout.max_response_tokens must be an int >= 1"),
    ("c.mopd.effort_mix = (1.0, float('nan'), 1.0); "
     "c.mopd.prompts_across_efforts = 'distinct'", "mopd.effort_mix"),
    ("c.teacher.outside_cell = 'gen/medium'", "not a teacher cell"),
    ("c.rl.lane_processes = 0", "rl.lane_processes"),
    ("c.mopd.prompts_across_efforts = 'paired'", "mopd.prompts_across_efforts"),
    ("c.mopd.prompts_across_efforts = 'distinct'; c.mopd.effort_mix = (1.0, -1.0, 1.0)",
     "mopd.effort_mix"),
    ("c.mopd.effort_mix = (1.0, 1.0, 2.0)", "needs mopd.prompts_across_efforts='distinct'"),
    ("c.rl.partial_rollout_tokens = 16; c.rl.sample_from = 'both'; "
     "c.rl.reference = 'sampler,sft'", "rl.partial_rollout_tokens with rl.sample_from='both'"),
    ("c.mopd.loss = 'vocab_kl'; c.mopd.length_groups = 3", "it needs mopd.length_groups=1"),
    ("c.mopd.loss = 'vocab_kl'; c.mopd.alpha = 0.5", "it needs mopd.alpha=0.0"),
    ("c.mopd.loss = 'kl'", "mopd.loss='kl'"),
    ("c.mopd.loss = 'outcome'", "it needs mopd.alpha > 0"),
    ("c.mopd.loss = 'mopd'; c.mopd.loss_args.vocab_kl.future_kl = 1.0",
     "mopd.loss_args.vocab_kl sets {'future_kl': 1.0}, but mopd.loss='mopd'"),
    ("c.mopd.loss = 'vocab_kl'; c.mopd.loss_args.vocab_kl.future_kl = -1.0",
     "mopd.loss_args.vocab_kl: future_kl must be"),
    ("c.mopd.loss = 'vocab_kl'; c.mopd.loss_args.vocab_kl = {'future_kl': 0.0, 'clip': 'yes'}",
     "mopd.loss_args.vocab_kl: vocab_kl.clip must be true or false"),
    ("c.mopd.loss = 'vocab_kl'; c.mopd.loss_args.vocab_kl.per = 'sequence'",
     "mopd.loss_args.vocab_kl: vocab_kl.per must be 'row'"),
    ("c.mopd.loss = 'vocab_kl'; c.mopd.loss_args.vocab_kl.future_baseline = True",
     "it needs vocab_kl.future_kl > 0"),
    ("c.rl.loss_args.pmd.token_clp = 1.0", "rl.loss_args.pmd.token_clp"),
    ("c.rl.loss_args.grpo.eps_low = 0.1",
     "rl.loss_args.grpo sets {'eps_low': 0.1}, but rl.loss='pmd'"),
    ("c.mopd.loss_args.kl = {}", "mopd.loss_args has block(s) ['kl'] of no mopd loss"),
    ("c.teacher.tokenizer_path = '/t/tokenizer.json'",
     "teacher.tokenizer_path is the tokenizer of teachers brought as checkpoints"),
    ("c.teacher.span_reward = 'first'", "teacher.span_reward"),
    ("c.teacher.tokenizer_path = '/t/tokenizer.json'; c.mopd.loss = 'topk'; " + _HF_ALL,
     "teachers of another tokenizer (teacher.tokenizer_path='/t/tokenizer.json') score spans"),
    ("c.teacher.tokenizer_path = '/t/tokenizer.json'; c.mopd.loss = 'vocab_kl'; " + _HF_ALL,
     "use mopd.loss='mopd'"),
    ("c.mopd.init_target = 'logits'", "mopd.init_target"),
    ("c.mopd.init_top_k = -1", "mopd.init_top_k"),
    ("c.mopd.init_target = 'distribution'; c.mopd.init = 'sft'",
     "it needs mopd.init='teacher_sft'"),
    ("c.teacher.tokenizer_path = '/t/tokenizer.json'; c.mopd.init_target = 'distribution'; "
     + _HF_ALL, "need mopd.init_target='tokens'"),
    ("c.teacher.tokenizer_paths = 'gen/low=/t/a.json'",
     "teacher.tokenizer_paths is the tokenizer of teachers brought as checkpoints"),
    ("c.teacher.tokenizer_paths = 'gen/low'; " + _HF_ALL,
     "teacher.tokenizer_paths: 'gen/low' is not 'domain/effort=file'"),
    ("c.teacher.tokenizer_paths = 'gen/huge=/t/a.json'; " + _HF_ALL,
     "teacher.tokenizer_paths names ['gen/huge'], not cells of the grid"),
    ("c.teacher.tokenizer_paths = 'gen/low=/t/a.json'; c.mopd.loss = 'vocab_kl'; " + _HF_ALL,
     "teachers of another tokenizer (teacher.tokenizer_paths={'gen/low': '/t/a.json'})"),
    ("c.mopd.loss = 'char_kl'", "it needs teacher.tokenizer_path or "
     "teacher.tokenizer_paths, got neither"),
    ("c.teacher.served_top_k = 0", "teacher.served_top_k"),
]


def test_bad_config_raises_under_python_O():
  """Every case in one `python -O` process (asserts stripped): each raises a ValueError
  whose message names the field."""
  code = ("import json, sys\nfrom configs import toy\nfrom mopd_jax import configure\n"
          "out = []\nfor change in json.load(sys.stdin):\n"
          "  c = toy.get_config('fast')\n  exec(change)\n"
          "  try:\n    configure.build(c, 1)\n  except ValueError as e:\n"
          "    out.append('ValueError: ' + str(e))\n  else:\n    out.append('no error')\n"
          "print(json.dumps(out))\n")
  res = subprocess.run([sys.executable, "-O", "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, input=json.dumps([c for c, _ in CASES]),
                       env=suite_cli.env())
  assert res.returncode == 0, res.stderr
  got = json.loads(res.stdout.strip().splitlines()[-1])
  wrong = [(change, match, msg) for (change, match), msg in zip(CASES, got)
           if not (msg.startswith("ValueError:") and match in msg)]
  assert not wrong, "\n".join(f"{c!r}: expected {m!r}, got {g!r}" for c, m, g in wrong)


def test_run_config_is_typed_and_frozen():
  """The toy, tiny and Qwen3 configs build into the typed schema; blocks are frozen."""
  import dataclasses

  from configs import base, qwen3_mopd, toy
  from mopd_jax.config import schema as config
  for c in (base.get_config(), toy.get_config(), toy.get_config("tiny"),
            qwen3_mopd.get_config("tiny")):
    rc = configure.build(c, 1)
    assert isinstance(rc.sft, config.SftConfig) and isinstance(rc.mopd, config.MopdConfig)
    assert rc.sft.schedule and set(rc.sft.schedule) == set(rc.grid.domains)
    assert isinstance(rc.rl.lr, float) and isinstance(rc.sft.steps, int)
    with pytest.raises(dataclasses.FrozenInstanceError):
      rc.sft.steps = 3
  rc = configure.build(toy.get_config(), 1)
  assert rc.sft.steps == 1040 and rc.mopd.prompts_across_efforts == "shared"
  assert rc.model.mapping()["num_layers"] == 4 and rc.teacher.hf_paths == {}
  assert rc.teacher.endpoints == {} and rc.teacher.retry_policy().retries == 4
  c = toy.get_config()
  c.mopd.loss = "mopd"  # servers return sampled-token log-probs: the toy's vocab_kl refuses them
  c.teacher.endpoints = ",".join(f"{n}=http://127.0.0.1:8000|http://127.0.0.1:8001/"
                                 for n in rc.grid.names)
  urls = configure.build(c, 1).teacher.endpoints
  assert urls == {n: ("http://127.0.0.1:8000", "http://127.0.0.1:8001") for n in rc.grid.names}


def test_unknown_key_and_wrong_type_are_rejected():
  from configs import toy
  c = toy.get_config("fast")
  c.lock()
  with pytest.raises(AttributeError):
    c.sft.stepz = 3
  with pytest.raises(TypeError):
    c.sft.steps = "many"


def test_batch_not_divisible_by_data_axis():
  from configs import toy
  c = toy.get_config("fast")
  c.mesh.data = 2
  with pytest.raises(ValueError, match="multiple of the data x fsdp"):
    configure.build(c, 2)


@pytest.mark.parametrize("args, match", [
    (["--config.sft.stepz=3"], "'stepz' Did you mean \"steps\""),
    (["--config.sft.steps=abc"], "--config.sft.steps=abc: invalid literal for int()"),
    (["--config.mopd.r_max=-1"], "mopd.r_max must be a finite number > 0"),
    (["--config.compile_cache={run}/xla"], "compile_cache may name only {workdir} in braces"),
    (["--config.stages=data", "--workdir="], "--workdir is required"),
])
def test_command_line_errors_are_one_line_and_exit_2(args, match):
  """A bad flag or value: one `config error:` line on stderr, exit status 2, no traceback,
  before any stage starts."""
  argv = ["--config", "configs/toy.py:fast", "--workdir", "/nonexistent/never_written"]
  if "--workdir=" in args:
    argv, args = ["--config", "configs/toy.py:fast"], [a for a in args if a != "--workdir="]
  res = subprocess.run([sys.executable, "-m", "experiments.run", *argv, *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=suite_cli.env())
  lines = [line for line in res.stderr.splitlines() if line.startswith("config error:")]
  assert res.returncode == 2 and len(lines) == 1 and match in lines[0], res.stderr[-2000:]
  assert "Traceback" not in res.stderr
  assert not os.path.exists("/nonexistent/never_written")


def test_missing_config_file_or_variant_is_one_line():
  for config, match in (("configs/nope.py", "No such file or directory"),
                        ("configs/toy.py:huge", "unknown config variant 'huge'")):
    res = subprocess.run([sys.executable, "-m", "experiments.run", "--config", config],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].startswith("config error:")
    assert match in res.stderr


def test_tool_markers_follow_the_run_domains():
  """The tokenizer is asked for tool markers only when a domain of the run uses tools: the
  toy's agt (<call> ...), a records domain of the tool verifier (<tool_call> ...); two
  domains that write different markers cannot share a tokenizer."""
  import ml_collections

  from configs import toy
  from mopd_jax.tasks import tools
  c = toy.get_config("fast")
  rc = configure.build(c, 1)
  assert rc.tool_markers == ("<call>", "</call>", "<obs>", "</obs>")
  assert rc.tokenizer_options().tools == rc.tool_markers
  c = toy.get_config("fast")
  c.domains = "gen,cod"
  assert configure.build(c, 1).tool_markers == ()
  c = toy.get_config("fast")
  c.tasks.tl = ml_collections.ConfigDict(dict(task="records", train="a.jsonl", test="b.jsonl",
                                              verifier="tool", validation=4))
  c.sft.schedule = ""  # round-robin over the run's domains
  c.domains = "gen,tl"
  assert configure.build(c, 1).tool_markers == tools.MARKERS
  c.domains = "gen,agt,tl"
  with pytest.raises(ValueError, match="domains 'agt' .* and 'tl' .* write different tool "
                     "markers; a run's tokenizer has one set"):
    configure.build(c, 1)


def test_the_entry_point_builds_the_run_config_once(tmp_path):
  """experiments/run.py builds the RunConfig once (before jax.distributed starts, without
  the device count, then checks the mesh) and hands it down; `Run` takes it as it is."""
  code = f"""
from absl import flags
from experiments import run as cli
from mopd_jax import configure, pipeline
from mopd_jax.stages import context
built, seen = [], {{}}
build = configure.build
configure.build = lambda config, n: (built.append(n), build(config, n))[1]
pipeline.run = lambda config, workdir: seen.update(run=context.Run(config, workdir))
flags.FLAGS(["run", "--config", "configs/toy.py:tiny", "--workdir", {str(tmp_path)!r}])
cli.main(["run"])
print(type(seen["run"].config).__name__, built)
"""
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, env=suite_cli.env())
  assert proc.stdout.split()[-2:] == ["RunConfig", "[None]"], proc.stdout + proc.stderr[-2000:]


def test_a_mesh_for_other_devices_is_refused_after_the_build():
  """`build(config, None)` leaves the device count to `check_devices`, which names both."""
  from configs import toy
  from mopd_jax.config import schema as config
  rc = configure.build(toy.get_config("tiny"), None)
  config.check_devices(rc, 1)
  with pytest.raises(config.ConfigError, match="has 1 devices but 4 are available"):
    config.check_devices(rc, 4)



def test_the_teacher_api_key_comes_from_the_environment_variable_named(monkeypatch):
  from configs import toy
  c = toy.get_config("fast")
  assert configure.build(c, 1).teacher.api_key() is None  # none named: no header sent
  c.teacher.api_key_env = "MOPD_TEST_TEACHER_KEY"
  rc = configure.build(c, 1)
  monkeypatch.delenv("MOPD_TEST_TEACHER_KEY", raising=False)
  with pytest.raises(ValueError, match="teacher.api_key_env='MOPD_TEST_TEACHER_KEY', but that "
                     "environment variable is unset or empty"):
    rc.teacher.api_key()
  monkeypatch.setenv("MOPD_TEST_TEACHER_KEY", "s3cret")
  assert rc.teacher.api_key() == "s3cret"


def test_the_parity_tolerance_defaults_by_the_servers_dtype():
  from configs import toy
  from mopd_jax.config import schema
  c = toy.get_config("fast")
  assert configure.build(c, 1).teacher.tolerance() == schema.PARITY_TOLERANCE["float32"]
  c.teacher.server_dtype = "bfloat16"
  assert configure.build(c, 1).teacher.tolerance() == schema.PARITY_TOLERANCE["bfloat16"]
  c.teacher.parity_tolerance = 0.05  # set: wins over the dtype's default
  assert configure.build(c, 1).teacher.tolerance() == 0.05
  c.teacher.server_dtype = "float16"
  with pytest.raises(ValueError, match="teacher.server_dtype"):
    configure.build(c, 1)


@pytest.mark.parametrize("row", sorted(ablate.ROWS))
def test_an_ablation_row_builds_a_valid_config(row):
  """Each `experiments.ablate` row's overrides name fields of its config variant, take their
  fields' types and pass the config's checks, and each lands in the built config (a misspelt
  path fails here, not after the rows before it have run)."""
  from configs import toy
  variant, overrides, _ = ablate.ROWS[row]
  if row == "sft_compute":
    overrides = overrides + ablate.sft_compute_overrides(os.path.join(ROOT, "configs", "toy.py"))
  c = toy.get_config(variant.lstrip(":") or None)
  parsed = []
  for o in overrides:
    key, value = o[len("--config."):].split("=")
    *parents, leaf = key.split(".")
    block = c
    for part in parents:
      block = block[part]
    old = block[leaf]  # a KeyError for a misspelt path
    new = {"True": True, "False": False}[value] if isinstance(old, bool) else type(old)(value)
    block[leaf] = new
    parsed.append((key, new))
  rc = configure.build(c, None)
  for key, new in parsed:
    parts = key.split(".")
    if parts[:2] == ["mopd", "loss_args"]:  # built: the chosen loss's own block, or none
      if parts[2] != rc.mopd.loss:
        continue  # another loss's block, left at its default (the config refuses a change)
      parts = parts[:2] + parts[3:]
    got = rc
    for part in parts:
      got = got[part] if isinstance(got, dict) else getattr(got, part)
    assert got == new, (row, key, got)
