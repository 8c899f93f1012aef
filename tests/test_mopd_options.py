"""MOPD-stage options: the outcome-reward term (`mopd.alpha`), the top-k distillation loss
(`mopd.loss = "topk"`), the teacher-SFT init's optimiser (`mopd.init_lr`,
`mopd.init_warmup_steps`), its soft targets (`mopd.init_target`) and the outside-teacher
ablation (`configs/toy_outside_teacher.py`)."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mopd_jax import models
from mopd_jax.io.tokenizer import CharTokenizer, DEFAULT_EFFORTS as EFFORTS
from mopd_jax.models import logprobs
from mopd_jax.rollout import turns as rollout
from mopd_jax.runtime import sharding
from mopd_jax.tasks import get_task, views
from mopd_jax.teachers import bank as teachers, placement
from mopd_jax.training import mopd, step as train
import suite_cli
import toy_grid
from toy_grid import DOMAINS
from mopd_jax import configure

ROOT = suite_cli.ROOT
TOK = CharTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, d_model=32, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=256)
B, T = 6, 16


def _arr(seed=0):
  """A padded rollout batch as `rollout.pad_batch` returns it."""
  r = np.random.RandomState(seed)
  pos = np.arange(T)[None]
  input_mask = pos < r.randint(8, T + 1, (B, 1))
  return {"tokens": r.randint(0, CFG.vocab_size, (B, T)).astype(np.int32),
          "input_mask": input_mask, "loss_mask": input_mask & (pos >= r.randint(2, 6, (B, 1))),
          "sampler_logprobs": -r.rand(B, T).astype(np.float32) * 3}


def test_outcome_advantages_per_cell_with_batch_fallback():
  r = np.array([1.0, 0.0, 1.0, 1.0, 0.0])
  ids = np.array([0, 0, 1, 1, 2])
  # cells 0 and 1 use their own mean; the single-row cell 2 falls back to the batch mean 0.6.
  np.testing.assert_allclose(mopd.outcome_advantages(r, ids), [0.5, -0.5, 0.0, 0.0, -0.6],
                             atol=1e-6)
  with pytest.raises(ValueError, match="same"):
    mopd.outcome_advantages(r, ids[:3])


@pytest.mark.parametrize("kind", ["mopd", "topk"])
def test_alpha_changes_the_loss_and_zero_alpha_is_the_old_path(kind):
  params = models.init_params(CFG, jax.random.PRNGKey(0))
  arr = _arr()
  lp_t = -np.random.RandomState(1).rand(B, T).astype(np.float32) * 3
  topk = None
  if kind == "topk":  # the teacher's top-4 at every position (another model's)
    st = logprobs.token_stats(CFG, models.init_params(CFG, jax.random.PRNGKey(1)),
                              arr["tokens"], input_mask=arr["input_mask"], top_k=4)
    topk = (np.asarray(st.topk_logprobs), np.asarray(st.topk_ids))
  old = train.TrainBatch(  # the batch the MOPD step built before the options existed
      tokens=jnp.asarray(arr["tokens"]), input_mask=jnp.asarray(arr["input_mask"]),
      loss_mask=jnp.asarray(arr["loss_mask"]),
      sampler_logprobs=jnp.asarray(arr["sampler_logprobs"]), teacher_logprobs=jnp.asarray(lp_t),
      teacher_topk_logprobs=None if topk is None else jnp.asarray(topk[0]),
      teacher_topk_ids=None if topk is None else jnp.asarray(topk[1]))
  lc = train.LossConfig(kind=kind)
  value_and_grad = jax.jit(jax.value_and_grad(
      lambda p, b: train.compute_loss(CFG, lc, p, batch=b)[0]))
  loss_old, g_old = value_and_grad(params, old)
  adv = mopd.outcome_advantages([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1, 2, 2])
  zero = mopd.train_batch(arr, lp_t, topk=topk, alpha=0.0, advantages_B=adv)
  assert zero.advantages is None  # nothing extra is traced at alpha = 0
  loss0, g0 = value_and_grad(params, zero)
  assert float(loss0) == float(loss_old)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g_old)):
    np.testing.assert_array_equal(a, b)
  # Centred advantages leave the loss value (ratio 1: -alpha * mean A = 0) but not its
  # gradient; uncentred ones move the value too.
  _, g1 = value_and_grad(params, mopd.train_batch(arr, lp_t, topk=topk, alpha=0.5,
                                                  advantages_B=adv))
  diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g1),
                                                          jax.tree.leaves(g_old)))
  assert diff > 1e-4
  loss2, _ = value_and_grad(params, mopd.train_batch(arr, lp_t, topk=topk, alpha=0.5,
                                                     advantages_B=np.ones(B)))
  np.testing.assert_allclose(float(loss2), float(loss_old) - 0.5, rtol=1e-5)
  with pytest.raises(ValueError, match="alpha"):
    mopd.train_batch(arr, lp_t, alpha=0.5)


def test_topk_mopd_step_is_zero_when_the_student_is_every_teacher():
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  params = models.init_params(CFG, jax.random.PRNGKey(0))
  bank = teachers.build_bank(CFG, [params] * 9, names=toy_grid.NAMES)
  scorer = placement.TeacherScorer(bank, mesh, mesh, top_k=4)
  trainer = train.Trainer(CFG, train.LossConfig(kind="topk"), train.OptimConfig(lr=1e-2),
                          mesh=mesh)
  tasks = {d: get_task(d) for d in DOMAINS}
  cells = [(d, e) for d in DOMAINS for e in EFFORTS]
  per_cell = [tasks[d].generate(seed=i, n=1) for i, (d, _) in enumerate(cells)]
  engine = rollout.RolloutEngine(CFG, TOK, max_response_tokens=12, max_turns=1)
  taus = {"max": 1.0, "high": 0.55, "low": 0.25}
  # Student == teacher gives zero only where the teachers read the student's own prompt
  # (the effort included): the view in which every party sees the effort.
  setup = mopd.StepSetup(bank, engine, tasks, cells, taus, view=views.EFFORT_EVERYWHERE)
  step = lambda state, score_fn, **kw: mopd.mopd_step(
      trainer, state, setup,
      examples_per_cell=per_cell, rng=jax.random.PRNGKey(3), r_max=5.0, score_fn=score_fn,
      **kw)
  state, rec = step(trainer.init(params), lambda b, t, m: scorer(t, m), alpha=0.0)
  m = rec.metrics
  assert m["loss"] == pytest.approx(0.0, abs=1e-6)
  assert m["topk_kl"] == pytest.approx(0.0, abs=1e-6)
  assert m["kl"] == pytest.approx(0.0, abs=1e-5)  # the sampled-token estimate, as for mopd
  assert m["grad_norm"] == pytest.approx(0.0, abs=1e-5)
  assert set(rec.cells) == set(toy_grid.NAMES)
  with pytest.raises(ValueError, match="top-k"):  # a scorer without top-k cannot feed it
    step(state, lambda b, t, m: scorer(t, m)[0])


@pytest.mark.slow  # a second SFT and RL lane in a subprocess: ~100 s on 2 cores
def test_outside_teacher_config_reports_initial_kl_per_cell(tmp_path):
  """One pipeline run of the ablation on the tiny variant, with the top-k loss and alpha on
  (so both options also run through the pipeline)."""
  env = suite_cli.env()
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.run", "--config", "configs/toy_outside_teacher.py:tiny",
       "--workdir", str(tmp_path), "--config.mopd.loss=topk", "--config.mopd.alpha=0.5"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  manifest = json.load(open(tmp_path / "teachers.json"))
  routed = manifest["teachers"]["cod/max"]
  assert routed["origin"] == "outside" and "rl_outside" in routed["path"]
  assert routed["parent"].endswith(os.path.join("sft", "outside", "params"))
  # The rest of the cod lane still anneals from the same-origin cod/max, kept on record.
  assert manifest["teachers"]["cod/high"]["parent"] == manifest["same_origin"]["cod/max"]["path"]
  rep = json.load(open(tmp_path / "report.json"))
  by_cell = rep["kl"]["initial_by_cell"]
  assert set(by_cell) == set(toy_grid.NAMES)
  assert {n for n, c in by_cell.items() if c["origin"] == "outside"} == {"cod/max"}
  assert set(rep["kl"]["initial_by_origin"]) == {"same", "outside"}
  assert by_cell["cod/max"]["kl"] == pytest.approx(rep["kl"]["initial_by_origin"]["outside"])
  pair = rep["kl"]["outside_vs_same"]["cod/max"]
  assert pair["same_accuracy"] == manifest["same_origin"]["cod/max"]["eval_validation"]["accuracy"]
  assert [c["name"] for c in rep["checks"] if c["name"].startswith("outside teacher")] == [
      "outside teacher cod/max validation accuracy - same-origin teacher's"]
  md = open(tmp_path / "report.md").read()
  assert "| cod/max | outside |" in md and "The outside `cod/max` teacher answers" in md
  history = json.load(open(tmp_path / "mopd" / "history.json"))
  assert "topk_kl" in history[0]  # the top-k loss was the one optimised


@pytest.mark.parametrize("change, match", [
    (dict(outside_cell="gen/medium"), "not a teacher cell"),
    (dict(outside_seed=0), "outside_seed"),
])
def test_bad_outside_teacher_config_raises(change, match):
  import configs.toy_outside_teacher as cfg_mod
  c = cfg_mod.get_config("fast")
  for k, v in change.items():
    setattr(c.teacher, k, v)
  with pytest.raises(ValueError, match=match):
    configure.build(c, 1)
  c = cfg_mod.get_config("fast")
  c.mopd.loss, c.mopd.loss_args.topk.k = "topk", 0
  with pytest.raises(ValueError, match=r"mopd\.loss_args\.topk: k must be"):
    configure.build(c, 1)


def test_teacher_sft_init_fine_tunes_at_its_own_rate_after_a_warmup():
  """The init's optimiser takes `mopd.init_lr` and `mopd.init_warmup_steps` (not pi_SFT's
  rate): no move at its first update, the peak rate at the warmup's end, and the toy's own
  setting is a fine-tuning rate below pi_SFT's."""
  from configs import toy
  from mopd_jax.stages import mopd_init as mopd_stage
  c = toy.get_config()
  built = configure.build(c, 1)
  assert built.mopd.init_lr < built.sft.lr and built.mopd.init_warmup_steps > 0
  c.mopd.init_lr, c.mopd.init_warmup_steps, c.mopd.init_sft_steps = 0.25, 4, 10
  ocfg = mopd_stage.init_optim(configure.build(c, 1).mopd)
  assert (ocfg.lr, ocfg.warmup_steps, ocfg.total_steps) == (0.25, 4, 10)
  params = {"w": jnp.ones((3,))}
  opt = train.make_optimizer(ocfg)
  state = opt.init(params)
  grads = {"w": jnp.full((3,), 0.5)}
  sizes = []
  for _ in range(5):
    upd, state = opt.update(grads, state, params)
    sizes.append(float(jnp.abs(upd["w"]).max()))
  assert sizes[0] == 0.0  # warmup starts at 0
  assert sizes[1] < sizes[2] < sizes[3] < sizes[4]
  np.testing.assert_allclose(sizes[4], 0.25, rtol=0.05)  # Adam's unit step at the peak rate


def test_init_lr_must_be_positive():
  from configs import toy
  from mopd_jax.config import schema as config_mod
  c = toy.get_config()
  c.mopd.init_lr = 0.0
  with pytest.raises(config_mod.ConfigError, match="init_lr"):
    configure.build(c, 1)


def test_soft_target_init_fits_each_response_position_to_its_teachers_distribution():
  """`mopd.init_target='distribution'`: `teacher_targets` holds teacher k's whole next-token
  distribution (its top-k with k the vocabulary, at the scoring bank's temperature) at each
  response position of its trajectories after its own effort-free prompt; `targets_on` lays
  them after the student's prompt (one token longer: the effort), and the init's
  `forward_kl` loss is the token mean of KL(teacher(. | x, y<t) || student(. | e, x, y<t))
  over the response tokens."""
  from mopd_jax.stages import mopd_init as stage
  from mopd_jax.training import registry
  v = CFG.vocab_size
  tparams = [models.init_params(CFG, jax.random.PRNGKey(i)) for i in (1, 2)]
  scoring = teachers.build_bank(CFG, tparams, names=("gen/high", "gen/max"))
  scoring = scoring.replace(params=models.with_temperature(scoring.params, 0.5))
  student = models.init_params(CFG, jax.random.PRNGKey(3))
  exs = get_task("gen", domain="gen").generate(0, 2)
  r = np.random.RandomState(0)
  trajs = [rollout.Trajectory(TOK.encode_prompt(ex.prompt, None),
                              [int(i) for i in r.randint(5, 40, n)], [1] * n, [0.0] * n, True)
           for ex, n in zip(exs, (5, 8))]
  targets = stage.teacher_targets(scoring, 1, trajs, pad_id=TOK.pad_id, top_k=v)
  lsm = lambda params, arr: np.asarray(jax.nn.log_softmax(models.forward(
      CFG, params, jnp.asarray(arr["tokens"]), input_mask=jnp.asarray(arr["input_mask"])), -1))
  want_t = lsm(models.with_temperature(tparams[1], 0.5), rollout.pad_batch(trajs, TOK.pad_id))
  for i, (t, (lp, ids)) in enumerate(zip(trajs, targets)):
    assert lp.shape == ids.shape == (t.num_tokens, v)
    full = np.zeros((t.num_tokens, v), np.float32)
    np.put_along_axis(full, ids, lp, -1)
    p = len(t.prompt_ids)
    np.testing.assert_allclose(full, want_t[i, p - 1:p - 1 + t.num_tokens], atol=2e-5)
  # After the student's prompt (with its effort), through the train step's loss.
  s_trajs = [dataclasses.replace(t, prompt_ids=TOK.encode_prompt(ex.prompt, "max"))
             for t, ex in zip(trajs, exs)]
  arr = rollout.pad_batch(s_trajs, TOK.pad_id)
  lp, ids = stage.targets_on(arr, s_trajs, targets)
  st = logprobs.token_stats(CFG, student, jnp.asarray(arr["tokens"]),
                            input_mask=jnp.asarray(arr["input_mask"]), top_k=v,
                            topk_ids_BxTxK=jnp.asarray(ids))
  loss, m = registry.loss_from_stats(
      train.LossConfig(kind="forward_kl", args=registry.TopkArgs(v)), st,
      train.TrainBatch.from_padded(arr, teacher_topk_logprobs=lp, teacher_topk_ids=ids))
  want_s = lsm(student, arr)
  kls = []
  for i, (t, s) in enumerate(zip(trajs, s_trajs)):
    pt, ps, n = len(t.prompt_ids), len(s.prompt_ids), t.num_tokens
    assert ps == pt + 1
    lt, ls = want_t[i, pt - 1:pt - 1 + n], want_s[i, ps - 1:ps - 1 + n]
    kls += list((np.exp(lt) * (lt - ls)).sum(-1))
  np.testing.assert_allclose(float(loss), np.mean(kls), rtol=1e-4)
  assert float(m["num_tokens"]) == 13 and float(loss) > 0



def test_soft_target_init_keeps_the_whole_vocabulary_only_where_the_host_holds_it():
  """`mopd.init_top_k` 0 keeps the whole vocabulary: the toy's 102 tokens, but a 152k
  vocabulary over a pool of 9 x 128 rollouts of 4096 tokens is refused at the stage's start
  with the field to set; a smaller top-k is kept as given."""
  import types
  from mopd_jax.stages import mopd_init as stage
  cfg = lambda k: types.SimpleNamespace(init_top_k=k, init_samples_per_cell=128)
  bank = lambda v: types.SimpleNamespace(model_cfg=types.SimpleNamespace(vocab_size=v),
                                         num_teachers=9)
  assert stage.init_top_k(cfg(0), bank(102), max_response_tokens=64) == 102
  assert stage.init_top_k(cfg(500), bank(102), max_response_tokens=64) == 102
  with pytest.raises(ValueError, match=r"GiB on the host.*set mopd\.init_top_k"):
    stage.init_top_k(cfg(0), bank(151_936), max_response_tokens=4096)
  assert stage.init_top_k(cfg(64), bank(151_936), max_response_tokens=4096) == 64
