"""Plugins from outside the package (tests/plugin_examples/): a loss with its own
hyperparameter block and a domain, each one file, named by `config.plugins` as
docs/walkthrough.md says, run through the tiny pipeline; the config's allowed loss names come
from the registry, and no module of mopd_jax tests a loss by its name."""
import ast
import json
import math
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import suite_cli
from configs import toy
from mopd_jax import configure
from mopd_jax.config import schema
from mopd_jax.training import losses, registry, step

ROOT = pathlib.Path(suite_cli.ROOT)
TESTS = ROOT / "tests"
PLUGINS = "plugin_examples.scaled_loss,plugin_examples.parity_domain"


def _config(**mopd):
  c = toy.get_config("tiny")
  c.plugins = PLUGINS
  c.domains, c.efforts = "gen,par", "low,max"
  c.sft.schedule = "gen,par"  # the toy's schedule names its own domains
  c.mopd.loss = "scaled_mopd"
  for k, v in mopd.items():
    setattr(c.mopd, k, v)
  return c


def test_a_plugin_loss_is_registered_with_its_args():
  rc = configure.build(_config(), 1)
  from plugin_examples import scaled_loss  # registered by the build above
  assert "scaled_mopd" in registry.names("mopd") and "scaled_mopd" not in registry.names("rl")
  assert rc.mopd.loss_args == scaled_loss.ScaledArgs(scale=1.0)  # the dataclass's default
  assert rc.grid.domains == ("gen", "par")
  c = _config()
  c.mopd.loss_args.scaled_mopd = {"scale": 2.5}
  assert configure.build(c, 1).mopd.loss_args.scale == 2.5
  c.mopd.loss_args.scaled_mopd.scale = 0.5  # what --config.mopd.loss_args.scaled_mopd.scale sets
  assert configure.build(c, 1).mopd.loss_args.scale == 0.5


@pytest.mark.parametrize("change, match", [
    (lambda c: setattr(c.mopd.loss_args, "scaled_mopd", {"scal": 2.0}),
     r"mopd\.loss_args\.scaled_mopd\.scal"),
    (lambda c: setattr(c.mopd.loss_args, "scaled_mopd", {"scale": -1.0}),
     r"mopd\.loss_args\.scaled_mopd: scale must"),
    (lambda c: (setattr(c.mopd, "loss", "mopd"),
                setattr(c.mopd.loss_args, "scaled_mopd", {"scale": 2.0})),
     r"mopd\.loss_args\.scaled_mopd sets \{'scale': 2\.0\}, but mopd\.loss='mopd'"),
    (lambda c: setattr(c.mopd.loss_args, "mopd", {"scale": 2.0}),
     r"mopd\.loss_args\.mopd sets \['scale'\], but loss 'mopd' takes no arguments"),
    (lambda c: setattr(c, "plugins", "plugin_examples.no_such_module"),
     r"plugins: cannot import 'plugin_examples.no_such_module'"),
    (lambda c: setattr(c.mopd, "loss", "pmd"), r"mopd\.loss='pmd'; expected one of"),
    (lambda c: setattr(c.rl, "loss", "scaled_mopd"), r"rl\.loss='scaled_mopd'; expected one of"),
])
def test_bad_plugin_settings_are_config_errors(change, match):
  c = _config()
  change(c)
  with pytest.raises(schema.ConfigError, match=match):
    configure.build(c, 1)


def test_the_plugin_loss_reads_its_args_through_the_step():
  """The train step's loss dispatch hands the plugin its args: scale x eq. 15's loss."""
  from plugin_examples import scaled_loss
  rng = np.random.default_rng(0)
  lp_s, lp_t = (jnp.asarray(-rng.random((3, 5)), jnp.float32) for _ in range(2))
  mask = jnp.asarray(rng.random((3, 5)) < 0.8)
  batch = type("Batch", (), dict(teacher_logprobs=lp_t, loss_mask=mask))()
  st = type("Stats", (), dict(logprobs=lp_s))()
  want, _ = losses.mopd_loss(lp_s, lp_t, mask, r_max=5.0)
  cfg = step.LossConfig(kind="scaled_mopd", args=scaled_loss.ScaledArgs(scale=3.0))
  got, _ = registry.loss_from_stats(cfg, st, batch)
  assert math.isclose(float(got), 3.0 * float(want), rel_tol=1e-6)
  assert step.LossConfig(kind="scaled_mopd").args == scaled_loss.ScaledArgs()  # None: defaults
  with pytest.raises(ValueError, match="takes args of type"):
    step.LossConfig(kind="scaled_mopd", args=registry.VocabKLArgs())
  with pytest.raises(ValueError, match="already registered"):
    registry.register_loss("scaled_mopd", separable=True)(lambda *a: None)


def test_the_plugin_domain_generates_and_verifies():
  """The verifier contract every package task meets (tests/test_tasks.py), on `par`; and
  the TFDS builder takes the domain whether it was registered before the builder module
  loaded (a named config) or after (a config object)."""
  from mopd_jax.tasks import base, datasets
  import plugin_examples.parity_domain  # noqa: F401  (registers `par`)
  from test_tasks import check_verifier_contract
  check_verifier_contract(base.get_task("par"), base.get_task("par").generate(seed=0, n=20))
  assert datasets.make_builder("par", "/nonexistent").builder_config.name == "par"


def test_a_plugin_domain_takes_its_options_from_its_task_block(tmp_path):
  """`tasks.par.num_bits` reaches the task's constructor, in the data it generates (a TFDS
  config of its own) and in the task the run builds; an unknown option or a value the task
  refuses is a config error naming the block."""
  from mopd_jax.stages import loops, sources
  c = _config()
  c.tasks.par = {"num_bits": 9}
  rc = configure.build(c, 1)
  assert rc.task_options == {"gen": {}, "par": {"num_bits": 9}}
  assert rc.task_options_json("par") == '{"num_bits": 9}' and rc.task_options_json("gen") == ""
  data = sources.DataSource(rc, data_dir=str(tmp_path / "data"),
                            files=loops.Workdir(str(tmp_path / "wd")))
  val = data.split("par", "validation")
  assert len(val) > 0 and all(len(val[i].meta["bits"]) == 9 for i in range(len(val)))
  default = sources.DataSource(configure.build(_config(), 1), data_dir=str(tmp_path / "data"),
                               files=loops.Workdir(str(tmp_path / "wd")))
  assert all(len(ex.meta["bits"]) == 7 for ex in [default.split("par", "validation")[0]])
  for block, match in (({"num_bit": 5}, r"tasks\.par has field\(s\) \['num_bit'\]; a domain of "
                                        r"task 'par' takes only 'task' and its options "
                                        r"\['num_bits'\]"),
                       ({"num_bits": 99}, r"tasks\.par: task 'par' refuses its options")):
    c = _config()
    c.tasks.par = block
    with pytest.raises(schema.ConfigError, match=match):
      configure.build(c, 1)


def test_a_plugin_loss_and_domain_run_the_tiny_pipeline(tmp_path):
  """`--config.plugins` names both modules (on the Python path, as a fork's package would
  be); every stage runs on the grid gen, par x low, max with the plugin's loss, the RL lane
  processes importing the plugins too."""
  wd = tmp_path / "run"
  env = dict(suite_cli.env(), PYTHONPATH=os.pathsep.join(
      [str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config",
                         "configs/toy.py:tiny", "--workdir", str(wd),
                         f"--config.plugins={PLUGINS}", "--config.domains=gen,par",
                         "--config.efforts=low,max", "--config.sft.schedule=gen,par",
                         "--config.mopd.loss=scaled_mopd"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rep = json.load(open(wd / "report.json"))
  cells = {(c["policy"], c["domain"], c["effort"]) for c in rep["cells"]}
  for policy in ("sft", "teacher", "student"):
    assert {(policy, "par", "low"), (policy, "par", "max")} <= cells
  hist = json.load(open(wd / "mopd" / "history.json"))
  assert hist and all(math.isfinite(h["loss"]) for h in hist)
  assert set(hist[0]["cells"]) == {"gen/low", "gen/max", "par/low", "par/max"}
  assert rep["config"]["mopd"]["loss"] == "scaled_mopd"


def _loss_name_tests(tree, names) -> list:
  """Comparisons of a loss-like expression (its text names `loss` or `kind`) with a string
  that is a registered loss name: `m.loss == "vocab_kl"`, `kind in ("pg", "topk")`."""
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, ast.Compare):
      continue
    sides = [node.left, *node.comparators]
    consts = set()
    for s in sides:
      elts = s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s]
      consts |= {e.value for e in elts if isinstance(e, ast.Constant) and
                 isinstance(e.value, str)}
    text = " ".join(ast.unparse(s) for s in sides)
    if consts & names and ("loss" in text or "kind" in text):
      out.append(f"{node.lineno}: {ast.unparse(node)}")
  return out


def test_no_module_tests_a_loss_by_its_name():
  names = set(registry.LOSS_KINDS)
  assert _loss_name_tests(ast.parse('if c.mopd.loss == "topk": pass'), names)  # can fail
  found = {}
  for path in sorted((ROOT / "mopd_jax").rglob("*.py")):
    hits = _loss_name_tests(ast.parse(path.read_text()), names)
    if hits:
      found[path.relative_to(ROOT).as_posix()] = hits
  assert not found, f"ask the loss's LossKind properties instead: {found}"
