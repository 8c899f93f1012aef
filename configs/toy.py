"""The embedded toy config: the whole pipeline on a 2-core CPU, in K3's form (the student's
prompt carries the effort, the teachers' prompts do not).

Run (seed 0 alone: 487 s on 2 CPU cores with tcmalloc, whose speed varies from run to run;
docs/toy_results.md):
    python -m experiments.run --config configs/toy.py --workdir /tmp/mopd_toy
The ablation in which the teachers see the effort: add --config.teacher.effort_in_prompt=True.
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

FROM_SFT_STEPS = 200  # MOPD steps of the from_sft variant


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: None for the default toy run, "fast" for the smoke variant, "tiny" for the
  reliability tests (fast with fewer steps and examples), "from_sft" for MOPD from pi_SFT
  without the teacher-SFT init, "cross_tokenizer" for the student of teachers of another
  tokenizer (of one family or several) and "two_families" for the same student distilled
  with eq. 15 by aligned spans (`experiments/cross_tokenizer.py` passes the teachers)."""
  if arg not in (None, "", "fast", "tiny", "from_sft", "cross_tokenizer", "two_families"):
    raise ValueError(f"unknown config variant {arg!r}; known: fast, tiny, from_sft, "
                     "cross_tokenizer, two_families")
  fast = arg in ("fast", "tiny")
  c = base.get_config()
  # A save of the toy's train state costs about half a second of the 2-core machine (orbax
  # writes it in the background, beside the next steps): every 10 steps that was a fifth of
  # the SFT stage (1040 updates of about 0.2 s). Every 50 bounds what a crash loses to 10-50 s
  # of work in each loop (a SIGTERM always saves); an RL phase of 20 steps saves at its end.
  # The smoke variants save every step so that the restart paths are exercised.
  c.checkpoint.every = 1 if fast else 50

  c.model.num_layers = 2 if fast else 4  # override of the preset's depth
  c.model.d_model = 64 if fast else 128  # override of the preset's width

  c.data.sizes = (400, 48, 48) if fast else (4000, 300, 300)  # train / validation / test

  # K3 eq. 15 as written (configs/base.py): the teachers are trained, evaluated and score
  # the student on prompts without the effort; the student's prompt carries it.
  # --config.teacher.effort_in_prompt=True runs the ablation in which the teachers see it.

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
  # Every domain: pi_SFT's greedy decode follows its most likely style, and with three
  # equal weights which one wins varies from run to run (with equal cod weights seed 0's
  # greedy cod was the full style, 0.938, which left its max teacher 6 points to add; with
  # equal gen weights seed 4's greedy gen was full, 0.990, which left it 1). Brief twice as
  # likely makes pi_SFT's greedy answer brief in every domain; RL at max then has to find
  # full among its samples (a quarter of them), as RL from a cold start is meant to.
  # AdamW's decoupled weight decay 0.1: without it seed 1's SFT never learned gen's full
  # style (its loss stayed at 0.48 through all 390 of gen's updates); with it, it does, late
  # (gen's loss falls from 0.50 to 0.23 over its last ~150 updates; the gen/max teacher then
  # reaches 1.000).
  # The smoke variants keep uniform weights and no decay: they check that every stage runs,
  # not what is learned.
  c.sft.style_weights = ml_collections.ConfigDict({"agt": (1.0, 2.0, 1.0)})
  if not fast:
    c.sft.style_weights.cod = (1.0, 2.0, 1.0)
    c.sft.style_weights.gen = (1.0, 2.0, 1.0)
    c.sft.weight_decay = 0.1
  # 24 sequences per update: half the compute of 48 for the same 1040 updates; on seed 0
  # it learned cod's full style (sampled accuracy 0.77) where 48 did not (0.34), gen's and
  # agt's as well (0.87, 0.89; docs/choices.md).
  c.sft.batch_size = 16 if fast else 24
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
  # The budget phases draw half of each prompt's samples from pi_SFT, the old policy they
  # are held to, and half from the teacher being trained (docs/choices.md). Their parent
  # writes only the style that no longer fits, so on-policy samples alone all run over
  # budget and the shorter style that came back first took over (seed 0: the effort-free
  # agt/high teacher settled on the direct answer); pi_SFT's samples alone keep every style
  # but leave the teacher's own mistakes unpenalised (its greedy answer ran over budget on
  # 7-9% of agt/high's validation prompts; 2% with both).
  c.rl.sample_from = "both"
  # The budget phases: against pi_SFT a smaller tau_kl gives sharper teachers. At lr 3e-4
  # seed 1's gen/high teacher still began the full style on 27% of its validation prompts
  # after its 20 steps (over budget); at 5e-4 none (0.567 at 14 tokens), and agt/high keeps
  # the brief style (0.72 at 23). 20 steps: they regress onto pi_SFT's samples, which hold
  # every style from the first step on.
  c.rl.anneal_lr = 5e-4
  c.rl.anneal_tau_kl = 0.2
  c.rl.anneal_steps = 0 if fast else 20
  # The plateau rule stays off: agt/max's reward (64 samples a step) is too noisy to tell a
  # plateau from its slow rise (window 4 would stop it after 8 of its 20 steps, before the
  # full style wins). The token clip stays off too: with a fixed reference a clipped token
  # gets no gradient, so nothing pulls back a token that has drifted more than the clip.
  # Three lane processes on 2 CPU cores finish sooner (one lane's decode loop leaves the
  # second core mostly idle). The smoke variants use 1: their lanes are a few seconds each,
  # less than a process takes to start.
  c.rl.lane_processes = 1 if fast else 3
  # Each teacher's validation table (informational; the eval stage measures every teacher
  # on the whole test split): 64 prompts cost a lane about 3 s a phase, 300 about 12.
  c.rl.validation_examples = 16 if fast else 64

  # The student starts from pi_SFT fine-tuned on its teachers' trajectories (K3 §4.1.2:
  # the experts' trajectories at every effort are collected for SFT and MOPD): 300 updates
  # on 128 rollouts per cell put each effort's style choice in the student (seed 0: its
  # KL(low || high) along its own rollouts 0.19 after 200; 0.0005 after 60 updates on 64;
  # at 200 seed 1's init still wrote `gen` alike at high and max, its KL(high || max)
  # 0.015-0.021 against 0.28-0.56 after 300, and missed the init's 5x, as did seed 2's);
  # 60 on-policy MOPD steps of 6 prompts per cell (54 rollouts) then distil the rest at a
  # fine-tuning rate (with eq. 15 at 1e-3 the seed-0 student's KL to its teachers rose from
  # 0.05 after the init to 0.43 within 25 steps before settling back). 400 updates on 512
  # rollouts per cell fit the teachers better (the init's held-out drop x9-x22 on seeds
  # 0-2), but the 60 steps after that init reach only x1.89 on seed 0: the held-out KL then
  # sits at a floor set by rare off-track rollouts (docs/toy_results.md, "The init's size").
  # The loss: K3 eq. 15's per-token update with its expectation over the sampled token taken
  # exactly (`vocab_kl`, mopd_jax/training/vocab_kl.py): the exact KL to the routed teacher over the
  # whole vocabulary at every position of the student's own rollouts. Eq. 15's one-token
  # estimate of it is mostly noise once the init has matched the teachers (seed 0's
  # initialised student, 8 batches: the cosine between its gradient and its expectation
  # 0.37 ± 0.08, between two batches' eq. 15 gradients 0.09 ± 0.05, vocab_kl's 0.21 ± 0.10;
  # Adam scales each step to the rate whatever its signal), and its 60 steps raised the
  # held-out KL (docs/choices.md); `--config.mopd.loss=mopd` runs eq. 15 as written. The smoke variants
  # keep eq. 15, the loss every placement, teacher server, staleness and partial-rollout
  # option takes (they score sampled tokens only), so their stage tests run as before;
  # tests/test_pipeline.py runs `vocab_kl` through the tiny run's stage.
  c.mopd.loss = "mopd" if fast else "vocab_kl"
  c.mopd.init = "teacher_sft"
  c.mopd.init_samples_per_cell = 8 if fast else 128  # teacher rollouts per cell
  c.mopd.init_sft_steps = 3 if fast else 300  # SFT updates on them
  # A fine-tuning rate with a warmup: at pi_SFT's own peak rate (3e-3) from the first update
  # seed 3's init loss rose from 0.13 to 0.28 within 20 updates, and pi_SFT's agt/max copy of
  # the question's name was lost (KL to its teacher at that character 0.27 -> 1.07), which
  # MOPD did not repair (docs/toy_results.md).
  c.mopd.init_lr = 3e-3 if fast else 1e-3
  c.mopd.init_warmup_steps = 0 if fast else 20
  c.mopd.steps = 3 if fast else 60
  c.mopd.lr = 3e-4
  c.mopd.prompts_per_cell = 1 if fast else 6  # b prompts per (domain, effort) cell per step
  # One batch per update: `vocab_kl` computes the teachers' distributions inside the update
  # and takes no length groups (`training/optim.py` `OptimConfig.length_groups`, which eq. 15 and the
  # other losses of the student's token stats can use). The smoke variants use 3, so the
  # default test tier runs the grouped update through the stage.
  c.mopd.length_groups = 3 if fast else 1
  # The toy's teachers are short RL runs, not converged: at temperature 1 each still writes
  # its other styles a third of the time (seed 0's gen/high teacher: brief 64%, direct
  # 30%), though its greedy answer, which the eval measures, is one style. Scored at 0.5
  # (and sampled at it for the init) they are the sharper teachers a converged run gives;
  # at 1 the seed-0 student matched gen/high's mixture and its greedy answer fell to the
  # direct style (0.41 at 6 tokens against the teacher's 0.65 at 14).
  c.mopd.teacher_temperature = 0.5
  # The student starts as pi_SFT at the teachers' scoring temperature (its final norm scale
  # doubled): scored at 0.5 the teachers are their policies with doubled logits, and a
  # student started at 1 stays under-confident through the init and the steps (seed 4's
  # final student sampled at 0.85 reads 0.6 of the held-out KL it reads at 1; the final norm
  # scale moves 0.93 -> 0.96 in 360 updates). docs/toy_results.md, "The student's start".
  c.mopd.start_temperature = c.mopd.teacher_temperature
  # Shared prompts: with distinct ones a student of 60 steps wrote agt's three styles in the
  # same mix at every effort.
  c.mopd.prompts_across_efforts = "shared"
  c.mopd.warmup_steps = 0 if fast else 5
  c.mopd.exact_kl_every = 1 if fast else 3  # the exact KL diagnostic (off the update's path)

  # 64 holds every gen and cod trajectory of a teacher's own style: the RL update costs
  # about 0.1 ms per padded token here.
  c.rollout.width = 64

  # Test examples per (domain, effort) cell: the whole test split. On 96 a cell near 0.2
  # accuracy (the low efforts' guesses) has a binomial standard error of 0.04, twice the
  # room the student's ">= 0.9 x its teacher" result leaves there (0.02); on 300 it is 0.023.
  c.eval.num_examples = 16 if fast else 300
  # The held-out KL results (the init's drop >= 5x, the on-policy drop >= 2x, no cell
  # rising): pi_SFT's, the initialised student's and the final student's exact KL to their
  # routed teachers on their own rollouts of the first 128 test prompts per domain at every
  # effort (1152 rollouts each), with standard errors (seed 0's on-policy drop: x2.22 ±
  # 0.68). 32 prompts (288 rollouts) would double the errors, too wide for a 2x bar. The
  # `agt` cells are dominated by rare rollouts that call a name the prompt does not hold and
  # then write what neither the student nor its teacher would.
  c.eval.kl_rollouts = 2 if fast else 128
  c.smoke.max_new_tokens = 32 if fast else 64
  if arg == "from_sft":
    # MOPD from pi_SFT with no teacher-SFT init: no teacher-generated token enters an
    # update, the student learns every cell from its own rollouts alone.
    c.mopd.init = "sft"
    c.mopd.steps = FROM_SFT_STEPS
    c.mopd.lr = 1e-3
    # Started at pi_SFT as trained: from its own samples alone the student must find each
    # max cell's full style, which pi_SFT at 0.5 rarely writes (seed 4 started at 0.5: gen/max
    # stays in the brief style, 0.643 at 14 tokens; docs/toy_results.md "MOPD from pi_SFT").
    c.mopd.start_temperature = 1.0
    # Eq. 15's reward clip at r_max inside the expectation (K3's form): the teachers scored at
    # 0.5 put the other styles' first tokens 7-10 nats below pi_SFT's (seed 4's gen), and
    # unclipped the tokens more than r_max from their teacher carry 0.35 of the logits'
    # gradient at the start (0.59 in gen/high; `experiments/clip_share.py`); one of gen's
    # high and max cells then stalled in the other's style on seeds 2 and 4
    # (docs/toy_results.md "MOPD from pi_SFT").
    c.mopd.loss_args.vocab_kl.clip = True
  if arg == "cross_tokenizer":
    # The student distils from teachers of another tokenizer, made by their own factory
    # (`python -m experiments.cross_tokenizer`, which passes `teacher.hf_paths` and
    # `teacher.tokenizer_path`; docs/cross_tokenizer.md). The default's init and start with
    # `char_kl`, the exact reverse KL to the teachers' next-character distributions
    # (mopd_jax/teachers/char_marginal.py): what `vocab_kl` is to eq. 15 over one vocabulary,
    # across tokenizers for a character-level student. Eq. 15 by spans with this init raised
    # the held-out log-ratio 3.8x and 4.0x (seeds 1 and 3), and from an init of 200 updates
    # started at 1 it did not lower it; `char_kl` here lowers it (docs/cross_tokenizer.md).
    # The held-out measure is the sampled sequence log-ratio (`agreement.logratio_rows`).
    c.mopd.loss = "char_kl"
    # 180 steps, three times the default's: at 60 the steps were still closing what the init
    # left. Seed 4's student, at 60 steps under its `cod/high` teacher (0.577 against 0.690),
    # meets it at 180 (0.650; its greedy answers part from the teacher's on 88 test prompts
    # against 102). Chosen on seed 4, then run on seeds 0-3 and 5-7 (7 never run before):
    # the final student's median and 99th-percentile held-out rollout are below the 60-step
    # student's on all eight seeds, its mean on six (level on 5, within a standard error on
    # 4); seed 6's student, matching its `agt/high` and `agt/max` teachers that answer
    # alike, loses its `agt` lengths' order by effort; seed 8 (run last, 18 of 21) has
    # teachers that add in their heads as seed 3's do (docs/cross_tokenizer.md, "Results on
    # the toy"). The default keeps its 60: at 180 its seed 4 student still misses
    # `cod/high` (0.567 against 0.657; 0.507 at 60).
    c.mopd.steps = 180
    # The student's own SFT takes 4160 updates, four times the teachers' factory's 1040: it
    # does not share their pi_SFT, and the on-policy steps do not teach it a skill its
    # pi_SFT lacks. At 1040 updates (and 2080) the character-level pi_SFT of seeds 0, 1, 3
    # and 4 copies `gen`'s memo where the BPE factory's pi_SFT of seed 3 adds its terms in
    # the head, and that student stayed under its `gen/high` teacher (0.717 against 0.817)
    # at 60 and 180 steps; at 4160 its pi_SFT adds them (p 1.000 on the stale-memo prompts,
    # `experiments.memo_probe`) and the student meets every result of seeds 0-4. Chosen on
    # seed 3, then run on seeds 0-2 and 4-8: 184 of 189 results at 1040 and at 4160, the final
    # held-out log-ratio lower on eight seeds and level on seed 8, whose pi_SFT does not add
    # at 4160 either (docs/cross_tokenizer.md, "The student's SFT").
    c.sft.steps = 4160
  if arg == "two_families":
    # Eq. 15 by aligned spans, for the comparison with `char_kl` (cross_tokenizer above) that
    # docs/cross_tokenizer.md reports with teachers of two families ("Two families on the
    # toy"): its best init there, 200 updates, started at 1 (started at the default's init
    # and temperature it raised the held-out log-ratio).
    c.mopd.loss = "mopd"
    c.mopd.init_sft_steps = 200
    c.mopd.start_temperature = 1.0
  if arg == "tiny":  # fewest steps that still give every loop a middle to interrupt
    # One layer and no QAT: compilation dominates a run this short and both nearly halve it.
    c.model.num_layers = 1
    c.model.quant = "none"
    c.data.sizes = (96, 8, 8)
    c.sft.steps = 4
    c.rl.steps_per_effort = 2
    c.mopd.steps = 2
    c.eval.num_examples = 4
    c.rl.validation_examples = 4
    c.rollout.max_response_tokens = 48
  return c
