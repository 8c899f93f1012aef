"""Which effort each party's prompt carries (mopd_jax/tasks/views.py): the view the config sets, the
prompts it renders for the student, the teachers, SFT and eval's policies, and the stages
asking the run's one view."""
import ast
import inspect
import os
import types

import numpy as np
import pytest

from mopd_jax import configure
from mopd_jax.io.tokenizer import load_tokenizer
from mopd_jax.rollout import turns as rollout
from mopd_jax.tasks import get_task, views
from mopd_jax.training import sft

EFFORTS = ("low", "high", "max")


@pytest.mark.parametrize("teacher_sees_effort", [False, True])
def test_each_partys_prompt_carries_the_effort_the_config_says(teacher_sees_effort):
  """K3 eq. 15 (`teacher.effort_in_prompt=False`): the student's, pi_SFT's and the student's
  eval prompts carry the effort, a teacher's (in its RL lane, MOPD scoring and eval) does
  not; the ablation (True) shows it to every party. SFT also trains on effort-free prompts
  exactly when the teachers see none."""
  tok = load_tokenizer("char", efforts=EFFORTS)
  view = views.PromptView.from_config(types.SimpleNamespace(
      effort_in_prompt=teacher_sees_effort))
  assert view == views.PromptView(teacher_sees_effort)
  assert view == (views.EFFORT_EVERYWHERE if teacher_sees_effort else views.K3)
  ex = get_task("gen").generate(0, 1)[0]
  for effort in EFFORTS:
    def carries(shown, effort=effort):
      ids = rollout.encode_prompt(tok, ex, shown)
      assert not {tok.effort_id(e) for e in EFFORTS if e != effort} & set(ids)
      return tok.effort_id(effort) in ids

    assert carries(view.student(effort))
    assert carries(view.teacher(effort)) == teacher_sees_effort
    assert carries(view.of("sft", effort)) and carries(view.of("student", effort))
    assert carries(view.of("teacher", effort)) == teacher_sees_effort
    if not teacher_sees_effort:
      assert rollout.encode_prompt(tok, ex, view.teacher(effort)) == \
          rollout.encode_prompt(tok, ex, None)
  with pytest.raises(ValueError, match="unknown policy"):
    view.of("oracle", "low")

  assert view.sft_extra_none is (not teacher_sees_effort)
  assert view.sft_choices(EFFORTS) == list(EFFORTS) + ([] if teacher_sees_effort else [None])
  effort_ids = {tok.effort_id(e) for e in EFFORTS}
  exs = get_task("gen").generate(0, 200)
  for mode in ("random", "style"):
    toks = np.asarray(sft.sft_batch(tok, exs, np.random.RandomState(3), width=64,
                                    draw=sft.SftDraw(mode, view=view)).tokens)
    effort_free = sum(not (set(row.tolist()) & effort_ids) for row in toks)
    assert (effort_free > 0) is (not teacher_sees_effort)


def _sft_efforts_as_drawn(view, mode, n, seed):
  """The SFT efforts of `n` examples as the rule of the module docstring of mopd_jax/training/sft.py
  draws them from `RandomState(seed)`: the style drawn first (3 styles, uniform), then the
  effort: random mode uniform over the efforts, plus none when the teachers see no effort;
  style mode the style's effort, dropped with probability 1/(|efforts| + 1) then."""
  rng, out = np.random.RandomState(seed), []
  for _ in range(n):
    style = ("full", "brief", "direct")[rng.randint(3)]
    if mode == "style":
      effort = sft.STYLE_EFFORT[style]
      if not view.teacher_sees_effort and rng.randint(len(EFFORTS) + 1) == 0:
        effort = None
    else:
      choices = list(EFFORTS) + ([] if view.teacher_sees_effort else [None])
      effort = choices[rng.randint(len(choices))]
    out.append(effort)
  return out


@pytest.mark.parametrize("view", [views.K3, views.EFFORT_EVERYWHERE])
@pytest.mark.parametrize("mode", ["random", "style"])
def test_sft_draws_its_efforts_as_the_view_says(view, mode):
  """`sft_batch` asks the view: each example's prompt carries the effort drawn by the rule
  (the same rng draws, in the same order)."""
  tok = load_tokenizer("char", efforts=EFFORTS)
  exs = get_task("gen").generate(0, 60)
  toks = np.asarray(sft.sft_batch(tok, exs, np.random.RandomState(5), width=64,
                                  draw=sft.SftDraw(mode, view=view)).tokens)
  names = {tok.effort_id(e): e for e in EFFORTS}
  got = [next((names[t] for t in row.tolist() if t in names), None) for row in toks]
  assert got == _sft_efforts_as_drawn(view, mode, len(exs), 5)


@pytest.mark.parametrize("flag", [False, True])
def test_the_run_builds_the_view_its_config_sets(flag, tmp_path):
  """`Run.view` is the view of `teacher.effort_in_prompt` (tiny toy config, both ways)."""
  import jax
  from configs import toy
  from mopd_jax.stages import context
  c = toy.get_config("tiny")
  c.teacher.effort_in_prompt = flag
  c.mesh.data = jax.device_count()  # the suite's simulated devices
  c.mopd.prompts_per_cell = jax.device_count()  # the MOPD batch splits over them
  ctx = context.Run(configure.build(c, jax.device_count()), str(tmp_path / "wd"))
  assert ctx.view == views.PromptView(teacher_sees_effort=flag)
  # The run builds one rollout engine per (model config, temperature): its compiled sampler
  # serves every teacher, phase and eval cell.
  assert ctx.engines.student is ctx.engines.make(ctx.model_cfg, c.rl.temperature)
  assert ctx.engines.eval is ctx.engines.make(ctx.model_cfg, c.eval.temperature)
  assert ctx.engines.make(ctx.model_cfg, 0.5) is not ctx.engines.make(ctx.model_cfg, 0.25)
  assert ctx.engines.make(ctx.model_cfg, 0.5).scfg.temperature == 0.5


# (stage module, call, the index of its positional effort argument or the name of its effort
# keyword, or None: a `view=` keyword)
STAGE_CALLS = (("sft", "SftDraw", None), ("rl", "PhaseSampling", None),
               ("rl", "measure", "prompt_effort"), ("rl", "evaluate", "effort"),
               ("mopd", "StepSetup", None), ("mopd_init", "run", 2),
               ("mopd_init", "encode_prompt", 2), ("eval", "evaluate", "effort"))


VIEWS = ("ctx.view.", "inp.view.")  # the run's view, or a stage's own inputs' view


def test_stages_ask_the_runs_view():
  """Every stage call that renders a party's prompt takes the run's view (`view=ctx.view`,
  or `inp.view` of a stage built with its own inputs) or an effort the view gives
  (`ctx.view.teacher(e)`, `ctx.view.of(policy, e)`, ...); no module outside views.py reads
  `teacher.effort_in_prompt`."""
  import mopd_jax
  from mopd_jax.stages import eval as eval_stage, mopd, mopd_init, rl, sft as sft_stage
  modules = {"sft": sft_stage, "rl": rl, "mopd": mopd, "mopd_init": mopd_init,
             "eval": eval_stage}
  found = set()
  for name, module in modules.items():
    tree = ast.parse(inspect.getsource(module))
    from_view = {n.targets[0].id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                 and ast.unparse(n.value).startswith(VIEWS)}
    for node in ast.walk(tree):
      if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        continue
      for mod, call, arg in STAGE_CALLS:
        if mod != name or node.func.attr != call:
          continue
        if call == "run" and "engine" not in ast.unparse(node.func):
          continue  # async_scoring.run: no prompt
        where = f"stages/{name}.py: {ast.unparse(node)[:80]}"
        if arg is None:
          assert {k.arg: ast.unparse(k.value) for k in node.keywords}.get("view") in \
              ("ctx.view", "inp.view"), where
        else:
          shown = (node.args[arg] if isinstance(arg, int) else
                   next(k.value for k in node.keywords if k.arg == arg))
          src = ast.unparse(shown)
          assert any(v in src for v in VIEWS) or src in from_view, where
        found.add((mod, call, arg))
  assert found == set(STAGE_CALLS)
  root = os.path.dirname(mopd_jax.__file__)
  for dirpath, _, files in os.walk(root):
    for f in files:
      if f.endswith(".py") and f != "views.py":
        with open(os.path.join(dirpath, f)) as fh:
          tree = ast.parse(fh.read())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                    and n.attr == "effort_in_prompt"], os.path.join(dirpath, f)


@pytest.mark.parametrize("config, arg", [("toy", None), ("toy", "fast"), ("toy", "tiny"),
                                         ("toy", "from_sft"), ("files", "examples/spec.json")])
def test_shipped_configs_run_k3s_form(config, arg):
  """The shipped configs pin K3 eq. 15's view (the teachers' prompts carry no effort); the
  ablation is asked for only on the command line. The library's dataclasses that take a
  view default to it too."""
  import dataclasses
  import importlib
  from mopd_jax.training import mopd, rl
  c = importlib.import_module(f"configs.{config}").get_config(arg)
  assert c.teacher.effort_in_prompt is False
  assert views.PromptView.from_config(c.teacher) == views.K3
  for cls in (mopd.StepSetup, rl.PhaseSampling, sft.SftDraw):
    default = {f.name: f.default for f in dataclasses.fields(cls)}["view"]
    assert default == views.K3, cls
