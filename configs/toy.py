"""The embedded toy config: the whole pipeline on a 2-core CPU.

Run:
    python -m experiments.run --config configs/toy.py --workdir /tmp/mopd_toy
Smoke variant of every stage (used by the tests, well under 2 minutes):
    python -m experiments.run --config configs/toy.py:fast --workdir /tmp/mopd_fast
Tiny variant for the reliability tests (every training loop, as few steps as possible):
    python -m experiments.run --config configs/toy.py:tiny --workdir /tmp/mopd_tiny
Override any field from the command line, e.g. `--config.rl.steps_per_effort=40`, or run a
subset of stages reusing earlier outputs: `--config.stages=sft,rl`.

Run a sub-grid of domains and efforts (names of the `tasks` and `effort` blocks):
    python -m experiments.run --config configs/toy.py:fast --workdir /tmp/mopd_2x2 \
        --config.domains=gen,cod --config.efforts=low,max

Stages, in order: data (TFDS builders) -> sft (pi_SFT, QAT) -> rl (3 domains x 3 efforts =
9 frozen teachers) -> mopd (the student) -> eval (pi_SFT, teachers, student on the test
split) -> report (report.json, report.md, PNG plots). `smoke` samples from a
freshly initialised model and prints the samples. Every field not set here is
configs/base.py's default.
"""
import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: None for the default toy run, "fast" for the smoke variant, "tiny" for the
  reliability tests (fast with fewer steps and examples)."""
  if arg not in (None, "", "fast", "tiny"):
    raise ValueError(f"unknown config variant {arg!r}; known: fast, tiny")
  fast = arg in ("fast", "tiny")
  c = base.get_config()
  # Toy steps take about a second, so saving every 10 keeps the save cost negligible; the
  # smoke variants save every step so that the restart paths are exercised.
  c.checkpoint.every = 1 if fast else 10

  c.model.num_layers = 2 if fast else 4  # override of the preset's depth
  c.model.d_model = 64 if fast else 128  # override of the preset's width

  c.data.sizes = (400, 48, 48) if fast else (4000, 300, 300)  # train / validation / test

  # The toy's measured results (README, docs/toy_results/) put the effort token in every
  # prompt, the teachers' too: the ablation of K3 eq. 15's effort-free teacher
  # (configs/base.py, docs/choices.md). --config.teacher.effort_in_prompt=False runs the
  # toy with teachers that do not see the effort.
  c.teacher.effort_in_prompt = True

  # Room for the full reasoning style (b0 = 1.1 x its length) and a mistake: an agt call of a
  # wrong name returns "error: unknown name" (19 tokens), and at tau 1.0 such a trajectory
  # runs over budget, so it scores -1, below the brief style's 0 for a wrong answer, and RL
  # at max prefers brief.
  c.effort.max.tau = 1.5
  # Brief fits (gen's, 14 tokens with EOS, with one to spare), full does not (it never does
  # below 1 / B0_MARGIN = 0.91).
  c.effort.high.tau = 0.72
  c.effort.low.tau = 0.3  # only a direct answer fits (cod's, 7 tokens, with one to spare)

  c.sft.steps = 12 if fast else 1040  # updates; each trains on one domain (sft.schedule)
  # With the token-mean SFT loss each style is learned in a phase change whose timing varies
  # with the seed (and float rounding). This sequence gives gen 390, cod 390 and agt 260 of
  # the 1040 updates; agt's cost the most (~0.6 s against cod's 0.38 and gen's 0.2: its
  # sequences are the longest). Seed 0: gen's full style learned after ~130 of its updates,
  # cod's after ~100. Seed 1: cod's after ~60, gen's not within 390 (nor within 200 of a
  # gen-only run), so gen's full style is the fragile one.
  c.sft.schedule = "gen,cod,agt,gen,cod,agt,gen,cod"
  # agt and cod: pi_SFT's greedy decode follows its most likely style, and with three equal
  # weights which one wins varies from run to run (with equal cod weights seed 0's greedy cod
  # was the full style, 0.938, which left its max teacher 6 points to add). Brief twice as
  # likely makes pi_SFT's greedy agt and cod brief; RL at max then has to find full among its
  # samples (a quarter of them), as RL from a cold start is meant to.
  # AdamW's decoupled weight decay 0.1: without it seed 1's SFT never learned gen's full
  # style (its loss stayed at 0.48 through all 390 of gen's updates); with it, it does, late
  # (gen's loss falls from 0.50 to 0.23 over its last ~150 updates; the gen/max teacher then
  # reaches 1.000).
  # The smoke variants keep uniform weights and no decay: they check that every stage runs,
  # not what is learned.
  c.sft.style_weights = ml_collections.ConfigDict({"agt": (1.0, 2.0, 1.0)})
  if not fast:
    c.sft.style_weights.cod = (1.0, 2.0, 1.0)
    c.sft.weight_decay = 0.1
  c.sft.batch_size = 16 if fast else 48  # sequences per update
  c.sft.warmup_steps = 2 if fast else 20  # linear warmup before the cosine decay

  c.rl.steps_per_effort = 2 if fast else 20  # RL iterations of the max phase
  c.rl.prompts_per_step = 4 if fast else 16  # prompts per iteration
  c.rl.group_size = 2 if fast else 4  # K samples per prompt
  # PMD's old policy: policy iteration at max ("sampler"), which makes the max teacher commit
  # to its best style; the budget phases held to pi_SFT ("sft"): they start from a teacher
  # that no longer writes the shorter styles, and all their first samples run over budget,
  # scoring -1 each, hence no advantage; the pull towards pi_SFT brings the shorter styles
  # back, and the budget's reward then selects among them. ("parent", every teacher a KL
  # step from its parent, keeps pi_SFT's mix of styles at max: agt/max stays brief.)
  c.rl.reference = "sampler,sft"
  # The budget phases: against pi_SFT a smaller tau_kl gives sharper teachers; at lr 5e-4
  # agt/high settles on the direct answer (5 tokens) within 20 steps instead of the more
  # accurate brief style. Their steps: the first ones bring the shorter styles back, the rest
  # choose among them (20 leave gen/high between its full and brief styles).
  c.rl.anneal_lr = 3e-4
  c.rl.anneal_tau_kl = 0.2
  c.rl.anneal_steps = 0 if fast else 30
  # The plateau rule stays off: agt/max's reward (64 samples a step) is too noisy to tell a
  # plateau from its slow rise (window 4 would stop it after 8 of its 20 steps, before the
  # full style wins). The token clip stays off too: with a fixed reference a clipped token
  # gets no gradient, so nothing pulls back a token that has drifted more than the clip.
  # Three lane processes on 2 CPU cores finish sooner (one lane's decode loop leaves the
  # second core mostly idle). The smoke variants use 1: their lanes are a few seconds each,
  # less than a process takes to start.
  c.rl.lane_processes = 1 if fast else 3

  # 300 student updates: at max the student has to leave pi_SFT's brief style for the
  # teacher's full one, and on-policy samples visit that choice rarely; with 150 the seeds
  # 1 and 2 students kept the high effort's style at agt/max (seed 2 also at cod/max).
  c.mopd.steps = 3 if fast else 300
  # 8 prompts per cell (72 rollouts a step): with 4 the agt cells' per-token KL stayed at
  # 0.05-0.09 to the end on seed 0 (agt/low's answer is a guessed name, a function of the
  # prompt that the student learns slowly from a few samples) and the run's exact KL fell
  # 3.7x, 12.7x, 4.7x on seeds 0, 1, 2 (first over last tenth of the steps); with 8 it falls
  # 14.3x, 17.6x, 7.4x, for about 1.3x the MOPD stage's time.
  c.mopd.prompts_per_cell = 1 if fast else 8  # b prompts per (domain, effort) cell per step
  # Shared prompts: with distinct ones a student of 60 steps wrote agt's three styles in the
  # same mix at every effort.
  c.mopd.prompts_across_efforts = "shared"
  c.mopd.warmup_steps = 0 if fast else 5
  c.mopd.init_samples_per_cell = 8 if fast else 64  # teacher rollouts per cell (teacher_sft)
  c.mopd.init_sft_steps = 3 if fast else 60  # SFT updates on them (teacher_sft)
  c.mopd.exact_kl_every = 1 if fast else 5  # the exact KL diagnostic (off the update's path)

  # 64 holds every gen and cod trajectory of a teacher's own style: the RL update costs
  # about 0.1 ms per padded token here.
  c.rollout.width = 64

  # Test examples per (domain, effort) cell: the whole test split. On 96 a cell near 0.2
  # accuracy (the low efforts' guesses) has a binomial standard error of 0.04, twice the
  # room the student's ">= 0.9 x its teacher" result leaves there (0.02); on 300 it is 0.023.
  # (The rl stage's validation report of each teacher reads as many validation examples.)
  c.eval.num_examples = 16 if fast else 300
  c.smoke.max_new_tokens = 32 if fast else 64
  if arg == "tiny":  # fewest steps that still give every loop a middle to interrupt
    # One layer and no QAT: compilation dominates a run this short and both nearly halve it.
    c.model.num_layers = 1
    c.model.quant = "none"
    c.data.sizes = (96, 8, 8)
    c.sft.steps = 4
    c.rl.steps_per_effort = 2
    c.mopd.steps = 2
    c.eval.num_examples = 4
    c.rollout.max_response_tokens = 48
  return c
