"""Golden MOPD losses that bind on every CPU: the first update's loss of each MOPD loss kind
through `mopd.train_on` (routing by (domain, effort), the teachers' effort-free view moved
back onto the student's positions, the loss) on a fixed batch, with teachers made from
pi_SFT by a deterministic transform instead of RL (whose sampled phases round differently
on different CPUs). Nothing here is sampled, so only float rounding can move the values.

To update after an intended change of behaviour: run this file, read the values the failed
assertion prints, replace `GOLDEN` and say why in the commit message."""
import numpy as np
import pytest

EFFORTS = ("low", "high", "max")
DOMAINS = ("gen", "agt", "cod")
GOLDEN = {"mopd": -2.5300607681274414, "vocab_kl": 0.19846612215042114}


def _first_loss(kind: str, *, permute: bool = False, teacher_sees_effort: bool = False,
                teacher_tok=None, metric: str = "loss"):
  import jax
  from mopd_jax import models
  from mopd_jax.io.tokenizer import load_tokenizer
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.runtime import sharding
  from mopd_jax.tasks import get_task, views
  from mopd_jax.teachers import bank as teachers
  from mopd_jax.training import mopd, step as train
  tok = load_tokenizer("char", efforts=EFFORTS)
  cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=32,
                          quant="none")
  sft = models.init_params(cfg, jax.random.PRNGKey(0))  # pi_SFT
  cells = [(d, e) for d in DOMAINS for e in EFFORTS]
  # Teacher k: pi_SFT at temperature 0.4 + 0.1 k, each cell's own distribution.
  temps = [0.4 + 0.1 * k for k in range(len(cells))]
  if permute:
    temps = temps[::-1]
  bank = teachers.build_bank(cfg, {f"{d}/{e}": models.with_temperature(sft, t)
                                   for (d, e), t in zip(cells, temps)})
  view = views.PromptView(teacher_sees_effort)
  tasks = {d: get_task(d) for d in DOMAINS}
  rng = np.random.RandomState(0)
  rows, efforts, trajs, texts = [], [], [], []
  for d, e in cells:
    for ex in tasks[d].generate(7, 2):
      ids = rng.randint(20, tok.vocab_size - 8, size=rng.randint(2, 12)).tolist() + [tok.eos_id]
      rows.append(ex)
      efforts.append(e)
      trajs.append(rollout.Trajectory(rollout.encode_prompt(tok, ex, view.student(e)), ids,
                                      [1] * len(ids), [0.0] * len(ids), True))
      texts.append(tok.decode(ids))
  setup = mopd.StepSetup(bank, rollout.RolloutEngine(cfg, tok, max_response_tokens=16), tasks,
                         cells, {"low": 0.3, "high": 0.72, "max": 1.5}, 32, view,
                         teacher_tok=teacher_tok)
  sampled = mopd._assemble(setup, rows, efforts, trajs=trajs, texts=texts,  # pylint: disable=protected-access
                           rows_per_teacher=2)
  # The sampler's log-probs: the student's own, teacher-forced (what sampling records).
  from mopd_jax.models import logprobs
  sampled.arr["sampler_logprobs"] = np.asarray(logprobs.token_logprobs(
      cfg, sft, sampled.arr["tokens"], input_mask=sampled.arr["input_mask"]))
  scored = teachers.score_stratified(bank, sampled.tokens, sampled.input_mask)
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  trainer = train.Trainer(cfg, train.LossConfig(kind=kind, r_max=5.0),
                          train.OptimConfig(lr=1e-3, warmup_steps=0, total_steps=2), mesh=mesh)
  _, rec = mopd.train_on(trainer, trainer.init(sft), bank, sampled=sampled, scored=scored,
                         r_max=5.0)
  return rec.metrics[metric]


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_first_mopd_loss_is_golden_on_every_cpu(kind):
  got = _first_loss(kind)
  assert got == pytest.approx(GOLDEN[kind], rel=1e-4, abs=1e-6), (
      f"first {kind} loss {got!r}; golden {GOLDEN[kind]!r} (see the module docstring)")


@pytest.mark.parametrize("kind", sorted(GOLDEN))
def test_golden_loss_moves_with_routing_and_view(kind):
  """The golden value binds: routing the rows to other teachers, or showing the teachers the
  effort (the ablation), moves the loss far beyond the golden tolerance."""
  base = _first_loss(kind)
  for other in (_first_loss(kind, permute=True), _first_loss(kind, teacher_sees_effort=True)):
    assert abs(other - base) > 100 * max(1e-4 * abs(base), 1e-6), (kind, base, other)


@pytest.mark.parametrize("metric", ["loss", "kl", "reward_mean", "clip_frac"])
def test_a_teacher_tokenizer_that_tokenizes_alike_is_eq_15_bitwise(metric):
  """The cross-tokenizer path (the response moved into the teacher's tokens, rewards by
  aligned spans) with a teacher tokenizer that tokenizes as the student's does, every span
  one token of each: the first update's loss and metrics equal eq. 15's bitwise."""
  from mopd_jax.io.tokenizer import load_tokenizer
  other = load_tokenizer("char", efforts=EFFORTS)  # its own instance: the cross path runs
  assert _first_loss("mopd", teacher_tok=other, metric=metric) == _first_loss("mopd",
                                                                              metric=metric)
