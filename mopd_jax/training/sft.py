"""Cold-start SFT on all domains' mixed-style data, and the evaluation every stage shares.

Effort token of an SFT example (`effort_mode`):
  * "random" (pi_SFT of the pipeline): a uniformly random effort token, so pi_SFT learns the
    mixture of styles and nothing about efforts; MOPD has to teach the student what each
    effort token means.
  * "style" (a measurement tool): full -> <max>, brief -> <high>, direct -> <low>, so one
    model can be asked for each style; used to measure accuracy by reasoning style.
With a view whose teachers see no effort (`views.PromptView.sft_extra_none`,
`teacher.effort_in_prompt=False`) one example in |efforts| + 1 (on average) has no effort in
its prompt, so pi_SFT, where every teacher starts, also answers the teachers' effort-free
prompts with the mixture of styles.

Examples of record files have one reference response (style "full"); each example's style
is drawn among the styles it has.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import numpy as np

from mopd_jax.io.tokenizer import DEFAULT_EFFORTS
from mopd_jax.rollout import turns as rollout
from mopd_jax.tasks import base as task_base, views
from mopd_jax.training import step as train

STYLE_EFFORT = {"full": "max", "brief": "high", "direct": "low"}
EVAL_BATCH = 64  # prompts per rollout batch of `evaluate`


def style_probs(weights: Optional[Sequence[float]], styles: Sequence[str]):
  """`weights` (one per style, any positive scale) as probabilities; None = uniform."""
  if weights is None:
    return None
  w = np.asarray(weights, np.float64)
  if w.shape != (len(styles),) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
    raise ValueError(f"style weights {tuple(weights)!r} must be {len(styles)} non-negative "
                     f"numbers, one per style of {tuple(styles)}, not all zero")
  return w / w.sum()


def schedule(spec: str, domains: Sequence[str], known: Sequence[str]) -> list:
  """The repeating sequence of domains SFT trains on, one per update (`sft.schedule`, e.g.
  "gen,agt,agt,cod,cod" gives the longer traces twice the updates; "" = round-robin over
  `domains`). Known domains outside the run's `domains` are dropped from it, so one config's
  schedule serves a `--config.domains` subset; it must still name every run domain."""
  spec = spec or ",".join(domains)
  out = [d.strip() for d in spec.split(",") if d.strip()]
  unknown = sorted(set(out) - set(known))
  out = [d for d in out if d in domains]
  if unknown or set(out) != set(domains):
    raise ValueError(f"sft.schedule={spec!r} must name every domain of {list(domains)} "
                     f"and no unknown one{f' (unknown: {unknown})' if unknown else ''}")
  return out


def domain_style_weights(spec, domains: Sequence[str], known: Sequence[str], *,
                         styles: Sequence[str] = task_base.STYLES) -> dict:
  """`sft.style_weights` as {domain: (w_full, w_brief, w_direct)} for the run's `domains`;
  a domain it does not name draws its styles uniformly, a known domain outside the run is
  ignored, an unknown one raises."""
  weights = {d: tuple(float(x) for x in w) for d, w in dict(spec or {}).items()}
  unknown = sorted(set(weights) - set(known))
  if unknown:
    raise ValueError(f"sft.style_weights names unknown domains {unknown}; known: "
                     f"{sorted(known)}")
  for w in weights.values():
    style_probs(w, styles)  # raises on a bad tuple
  return {d: w for d, w in weights.items() if d in domains}


@dataclasses.dataclass(frozen=True)
class SftDraw:
  """How an example becomes an SFT row: one of its reference solutions, drawn uniformly
  or, for a domain named in `style_weights`, with that domain's weights over `styles`
  (among the styles the example has); its effort (effort_mode "random") drawn uniformly
  from `view.sft_choices(efforts)` (`efforts`, plus none when the view's teachers see no
  effort; the style mode then drops the style's effort with probability 1/(|efforts|+1));
  `view`: which prompts SFT trains on (`views.PromptView`; see the module docstring)."""
  effort_mode: str
  style_weights: Optional[Mapping[str, Sequence[float]]] = None
  efforts: Sequence[str] = DEFAULT_EFFORTS
  view: views.PromptView = views.K3
  styles: Sequence[str] = task_base.STYLES


def sft_batch(tok, examples: Sequence[task_base.Example], rng: np.random.RandomState, *,
              width: int, draw: SftDraw) -> train.TrainBatch:
  """One batch of `examples` drawn as `draw` says (`SftDraw`), padded to `width`."""
  styles, view, efforts, effort_mode = draw.styles, draw.view, draw.efforts, draw.effort_mode
  probs = {d: style_probs(w, styles) for d, w in (draw.style_weights or {}).items()}
  trajs = []
  for ex in examples:
    have = [s for s in styles if s in ex.solutions]
    if not have:
      raise ValueError(f"example {ex.uid!r} has no reference response to train SFT on")
    if len(have) < len(styles):  # a record's single reference: no draw
      style = have[rng.randint(len(have))]
    else:
      p = probs.get(ex.domain)
      style = styles[rng.randint(len(styles)) if p is None else rng.choice(len(styles), p=p)]
    if effort_mode == "style":
      effort = STYLE_EFFORT[style]
      if view.sft_extra_none and rng.randint(len(efforts) + 1) == 0:
        effort = None
    elif effort_mode == "random":
      choices = view.sft_choices(efforts)
      effort = choices[rng.randint(len(choices))]
    else:
      raise ValueError(f"unknown effort_mode {effort_mode!r}; expected 'random' or 'style'")
    trajs.append(rollout.sft_trajectory(tok, ex, effort, response=ex.solutions[style]))
  return train.TrainBatch.from_padded(rollout.pad_batch(trajs, tok.pad_id, width))


@dataclasses.dataclass(frozen=True)
class SftBatches:
  """Each SFT step's batch: `next_examples(step)` returns the step's examples, drawn as
  `draw` says and padded to `width` (an int, or a function of the step's examples returning
  it). The batch rng is a pure function of (seed, step), so a resumed run sees the same
  data."""
  tok: Any
  next_examples: Callable[[int], list]
  draw: SftDraw
  width: Any
  seed: int

  def __call__(self, step: int) -> train.TrainBatch:
    rng = np.random.RandomState([self.seed, step])
    exs = self.next_examples(step)
    width = self.width(exs) if callable(self.width) else self.width
    return sft_batch(self.tok, exs, rng, width=width, draw=self.draw)


def train_sft(trainer: train.Trainer, state: train.TrainState, batches: SftBatches, *,
              steps: int, log: Optional[Callable] = None, start_step: int = 0, loop=None):
  """Runs `steps` SFT updates on `batches(step)`.

  `loop`: a `checkpoint.TrainLoop` (per-step checkpoints, SIGTERM, non-finite policy); the
  run then starts at `loop.start_step` and the returned history includes restored steps.
  """
  history = []
  if loop is not None:
    start_step, history = loop.start_step, loop.history
  for step in range(start_step, steps):
    state, m = trainer.step(state, batches(step))
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    if loop is not None:
      loop.end_step(step, state, m, record=[step, m["loss"]])  # appends to `history`
    elif not m["finite"]:
      raise FloatingPointError(f"SFT step {step}: non-finite loss {m['loss']} or grad norm "
                               f"{m['grad_norm']}")
    else:
      history.append([step, m["loss"]])
    if log is not None:
      log(step, m)
  return state, history


@dataclasses.dataclass(frozen=True)
class EvalHooks:
  """What `evaluate` calls besides sampling: `on_rollouts(examples, result)` sees each
  batch's rollouts (the eval stage scores them with the teachers)."""
  on_rollouts: Optional[Callable[[list, rollout.RolloutResult], None]] = None


def evaluate(engine: rollout.RolloutEngine, params, task, *,
             examples: Sequence[task_base.Example], effort: Optional[str],
             budgets: Sequence[int], rng,
             hooks: "EvalHooks" = None) -> dict:
  """Accuracy, mean and 90th-percentile length and over-budget rate of greedy-or-sampled
  rollouts at `budgets`, lengths in the tokens `engine` counts budgets in; `hooks`
  (`EvalHooks`) sees the rollouts.

  `effort`: the effort the evaluated policy's prompt carries (`views.PromptView.of`);
  None = an effort-free prompt (a teacher of K3 eq. 15).
  Accuracy counts a response only if it finished within its budget (as the RL reward does).
  """
  hooks = EvalHooks() if hooks is None else hooks
  on_rollouts = hooks.on_rollouts
  correct, lengths, over = [], [], []
  for lo in range(0, len(examples), EVAL_BATCH):
    exs = list(examples[lo:lo + EVAL_BATCH])
    res = engine.run(params, exs, [effort] * len(exs),
                     budgets=budgets[lo:lo + EVAL_BATCH],
                     rng=jax.random.fold_in(rng, lo), environment=task.environment)
    if on_rollouts is not None:
      on_rollouts(exs, res)
    # lengths and budgets in the tokens the engine counts in (`RolloutEngine.result`)
    n, ob = [int(k) for k in res.lengths], [bool(o) for o in res.over_budget]
    correct += task.verify_unless(exs, res.texts, np.asarray(ob), fill=0.0)
    lengths += n
    over += ob
  return {"accuracy": float(np.mean(correct)), "mean_length": float(np.mean(lengths)),
          "p90_length": float(np.percentile(lengths, 90)),
          "over_budget_rate": float(np.mean(over)), "n": len(examples)}
