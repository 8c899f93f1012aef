"""The embedded toy config: the whole pipeline on a 2-core CPU.

Run:
    python -m experiments.run --config configs/toy.py --workdir /tmp/mopd_toy
Smoke variant of every stage (used by the tests, well under 2 minutes):
    python -m experiments.run --config configs/toy.py:fast --workdir /tmp/mopd_fast
Tiny variant for the reliability tests (every training loop, as few steps as possible):
    python -m experiments.run --config configs/toy.py:tiny --workdir /tmp/mopd_tiny
Override any field from the command line, e.g. `--config.rl.steps_per_effort=40`, or run a
subset of stages reusing earlier outputs: `--config.stages=sft,rl`.

Stages, in order: data (TFDS builders) -> sft (pi_SFT, QAT) -> rl (3 domains x 3 efforts =
9 frozen teachers) -> mopd (the student) -> eval (pi_SFT, teachers, student on the test
split) -> report (report.json, report.md, PNG plots). `smoke` samples from a
freshly initialised model and prints the samples.
"""
import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: None for the default toy run, "fast" for the smoke variant, "tiny" for the
  reliability tests (fast with fewer steps and examples)."""
  if arg not in (None, "", "fast", "tiny"):
    raise ValueError(f"unknown config variant {arg!r}; known: fast, tiny")
  fast = arg in ("fast", "tiny")
  c = ml_collections.ConfigDict()
  c.seed = 0  # every rng in the run is derived from this
  c.stages = "data,sft,rl,mopd,eval,report"  # comma-separated subset, run in pipeline order
  c.log_every = 10  # console / TensorBoard interval in steps
  # A step whose loss or gradient norm is not finite is never applied. False: stop with a
  # message naming the step and the metric; True: skip such steps and count the skips.
  c.skip_nonfinite = False

  # Per-step checkpoints of every training loop (orbax, last 2 complete steps kept, saved
  # asynchronously): a SIGTERM always saves the step it interrupts, so the interval only
  # bounds the work a SIGKILL or crash can lose. Toy steps take about a second, so saving
  # every 10 keeps the save cost negligible; the smoke variants save every step so that
  # the restart paths are exercised.
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 1 if fast else 10  # steps between saves

  c.model = ml_collections.ConfigDict()
  c.model.preset = "toy"  # a name from mopd_jax.models.PRESETS
  c.model.num_layers = 2 if fast else 4  # override of the preset's depth
  c.model.d_model = 64 if fast else 128  # override of the preset's width
  c.model.quant = "int4"  # QAT from SFT on: none | int8 | int4 (group-wise)
  c.model.quant_group = 32  # weights per quantisation group
  # Activation rematerialisation of the training forward: none | block (jax.checkpoint per
  # transformer block) | dots (saving the weight-matmul outputs). Exact; toy activations
  # are small, so none (the fastest).
  c.model.remat = "none"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # mesh axis sizes; their product must equal the device count
  c.mesh.fsdp = 1  # splits the batch and also the params (their embed dimension)
  c.mesh.tensor = 1  # splits attention heads, MLP columns and the vocabulary

  c.data = ml_collections.ConfigDict()
  c.data.sizes = (400, 48, 48) if fast else (4000, 300, 300)  # train / validation / test
  c.data.dir = ""  # TFDS data_dir; empty = <workdir>/data

  # Effort levels: budget of example x at effort e is floor(tau_e * b0(x)) tokens.
  c.effort = ml_collections.ConfigDict()
  # Room for the full reasoning style (b0 = 1.1 x its length) and a mistake: an agt call of a
  # wrong name returns "error: unknown name" (19 tokens), and at tau 1.0 such a trajectory
  # ran over budget, so it scored -1, below the brief style's 0 for a wrong answer, and RL
  # at max preferred brief.
  c.effort.tau_max = 1.5
  # Brief fits (gen's, 14 tokens with EOS, with one to spare), full does not (it never does
  # below 1 / B0_MARGIN = 0.91).
  c.effort.tau_high = 0.72
  c.effort.tau_low = 0.3  # only a direct answer fits (cod's, 7 tokens, with one to spare)

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 12 if fast else 1040  # updates; each trains on one domain (sft.schedule)
  # The repeating sequence of domains, one per update; empty = round-robin (gen,agt,cod).
  # With the token-mean SFT loss each style is learned in a phase change whose timing varies
  # with the seed (and float rounding). This sequence gives gen 390, cod 390 and agt 260 of
  # the 1040 updates; agt's cost the most (~0.6 s against cod's 0.38 and gen's 0.2: its
  # sequences are the longest). Seed 0: gen's full style learned after ~130 of its updates,
  # cod's after ~100. Seed 1: cod's after ~60, gen's not within 390 (nor within 200 of a
  # gen-only run), so gen's full style is the fragile one.
  c.sft.schedule = "gen,cod,agt,gen,cod,agt,gen,cod"
  # Per domain, the weights of the reference styles (full, brief, direct) in SFT data; a
  # domain not named draws them uniformly. agt: pi_SFT's greedy decode follows its most
  # likely style, and with three equal weights which one wins varied from run to run (full,
  # 0.990, in session 9, which left RL nothing to add at max effort). Brief twice as likely
  # makes pi_SFT's greedy agt brief; RL at max then has to find full among its samples (a
  # quarter of them), as RL from a cold start is meant to.
  c.sft.style_weights = ml_collections.ConfigDict({"agt": (1.0, 2.0, 1.0)})
  c.sft.batch_size = 16 if fast else 48  # sequences per update
  c.sft.lr = 3e-3  # AdamW peak learning rate (warmup + cosine)
  c.sft.warmup_steps = 2 if fast else 20  # linear warmup before the cosine decay
  # AdamW's decoupled weight decay. 0.1 let seed 1's SFT learn gen's full style, but in
  # seed 0's run made pi_SFT's greedy cod the full style (36 of 39 bars; docs/toy_history.md).
  c.sft.weight_decay = 0.0
  # Gradient accumulation (train.OptimConfig.microbatches): each update's rows in this many
  # equal slices, one slice's activations alive at a time; the same update, exactly.
  c.sft.microbatches = 1
  c.sft.effort_mode = "random"  # effort token of SFT examples: random | style (see sft.py)

  c.rl = ml_collections.ConfigDict()
  c.rl.loss = "pmd"  # pmd (Kimi K1.5/K2 policy mirror descent) | grpo (clipped ratio)
  c.rl.steps_per_effort = 2 if fast else 20  # RL iterations per effort level and domain
  c.rl.prompts_per_step = 4 if fast else 16  # prompts per iteration
  c.rl.group_size = 2 if fast else 4  # K samples per prompt
  c.rl.microbatches = 1  # gradient accumulation; slices must hold whole groups
  # PMD's old policy per effort phase (max, high, low), or one value for all: "sampler" (the
  # policy that sampled the batch, one update old: policy iteration, which makes the max
  # teacher commit to its best style) | "sft" (the lane's pi_SFT, held fixed: the high and low
  # phases start from a teacher that no longer writes the shorter styles, and all their first
  # samples run over budget, scoring -1 each, hence no advantage; the pull towards pi_SFT
  # brings the shorter styles back, and the budget's reward then selects among them) |
  # "parent" (the effort's parent teacher, held fixed: every teacher stays a KL step from
  # its parent, so the max teacher kept pi_SFT's mix of styles and agt/max stayed brief).
  c.rl.reference = "sampler,sft,sft"
  c.rl.lr = 3e-4  # AdamW learning rate of the max phase (cosine over each phase's steps)
  c.rl.tau_kl = 0.5  # PMD log-ratio weight of the max phase
  # The budget phases (high, low); 0 = as max. Against pi_SFT a smaller tau_kl gives sharper
  # teachers. At lr 5e-4 agt/high settled on the direct answer (5 tokens) within its 20
  # steps instead of the more accurate brief style.
  c.rl.anneal_lr = 3e-4
  c.rl.anneal_tau_kl = 0.2
  # Their steps: the first ones bring the shorter styles back, the rest choose among them
  # (20 left gen/high between its full and brief styles, 65% over budget).
  c.rl.anneal_steps = 0 if fast else 30
  # The reward-plateau stopping rule of every phase, on top of the step count: stop once the
  # mean sample reward of the last `plateau_window` steps is less than `plateau_delta` above
  # that of the window before; 0 = off. Off in the toy: agt/max's reward (64 samples a step)
  # is too noisy to tell a plateau from its slow rise (window 4 would stop it after 8 of
  # its 20 steps, before the full style wins).
  c.rl.plateau_window = 0
  c.rl.plateau_delta = 0.02
  # PMD per-token log-ratio clip (K2.5-style regulariser); 0 = off. Off with a fixed
  # reference: a clipped token gets no gradient, so nothing pulls back a token that has
  # drifted more than the clip from it.
  c.rl.token_clip = 0.0
  c.rl.temperature = 1.0  # sampling temperature of RL rollouts
  # Lanes side by side, each in a process of its own (mopd_jax/lanes.py), or 1: one after
  # another in this process. Same teachers either way. On 2 CPU cores three processes
  # finish sooner (one lane's decode loop leaves the second core mostly idle); on one
  # accelerator use 1. The smoke variants use 1: their lanes are a few seconds each, less
  # than a process takes to start.
  c.rl.lane_processes = 1 if fast else 3

  c.mopd = ml_collections.ConfigDict()
  # Student updates with shared prompts. 100 gave 8 of 9 cells at >= 0.9 x the teacher's
  # accuracy in session 8 (60 gave 5 with distinct prompts; lr 2e-3 broke agt/max); 150 in
  # session 9 took the KL down 11.5x first/last (4.6x over tenths).
  c.mopd.steps = 3 if fast else 150
  c.mopd.prompts_per_cell = 1 if fast else 4  # b prompts per (domain, effort) cell per step
  # distinct: each cell of a domain gets its own prompts | shared: the domain's b prompts are
  # posed at every effort, so the efforts' updates differ by the effort token alone (with
  # distinct prompts the student of 60 steps wrote agt's three styles in the same mix at
  # every effort).
  c.mopd.prompts_across_efforts = "shared"
  # Effort mix (distinct only): weights of (low, high, max); each prompt's effort is drawn
  # from them, so cells vary in size from step to step (the teachers' batch is padded to the
  # largest possible cell). () = prompts_per_cell prompts in every cell.
  c.mopd.effort_mix = ()
  c.mopd.lr = 1e-3  # AdamW peak learning rate of the student
  c.mopd.warmup_steps = 0 if fast else 5  # linear warmup before the cosine decay
  c.mopd.microbatches = 1  # gradient accumulation (also of the teacher_sft init)
  c.mopd.r_max = 5.0  # clip of the per-token reward r_t (K3 eq. 15)
  # Temperature of the teachers' log-probs in r_t: 1 = K3 eq. 15 as written; < 1 sharpens
  # each teacher towards its greedy behaviour (what the eval measures).
  c.mopd.teacher_temperature = 1.0
  # mopd (eq. 15) | pg (clipped ratio, reward as advantage) | topk (ablation: reverse KL on
  # the routed teacher's top_k tokens at each position, corrected for the truncation)
  c.mopd.loss = "mopd"
  c.mopd.top_k = 8  # teacher tokens per position of the topk loss
  # Weight of the outcome-reward term: alpha * (verifier reward - its (domain, effort)
  # cell's batch mean) on every generated token, REINFORCE; 0 = pure distillation.
  c.mopd.alpha = 0.0
  # Teacher scoring one step behind sampling: 0 = synchronous; 1 = the teachers score batch
  # k while the student samples batch k+1 (worth it with placement "disaggregated"). The
  # one-update-stale batch is trained with truncated importance weights
  # clip(pi_theta / pi_sampler, *is_bounds) on every token.
  c.mopd.staleness = 0
  c.mopd.is_bounds = (0.5, 2.0)
  # Student initialisation: sft (pi_SFT, as the MOPD paper assumes) | teacher_sft (pi_SFT
  # further fine-tuned on trajectories of all nine teachers, each with its effort token).
  c.mopd.init = "sft"
  c.mopd.init_samples_per_cell = 8 if fast else 64  # teacher rollouts per cell (teacher_sft)
  c.mopd.init_sft_steps = 3 if fast else 60  # SFT updates on them (teacher_sft)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.max_response_tokens = 96  # hard cap on a response (generated + observations)
  c.rollout.max_turns = 4  # tool calls per agt trajectory
  # Least padded length of RL train batches (prompt + response); a batch is padded to the
  # power of two holding its longest trajectory. 64 holds every gen and cod trajectory of a
  # teacher's own style: the update costs about 0.1 ms per padded token here.
  c.rollout.width = 64

  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 16 if fast else 96  # test examples per (domain, effort) cell
  c.eval.temperature = 0.0  # 0 = greedy

  # Profiling switch (off by default): trace steps [start_step, start_step + num_steps) of
  # one training loop with the JAX profiler into <workdir>/profile/<loop>/. `stage`: "" (off),
  # "sft", "rl" (the first RL run; "rl gen/high" picks one), "mopd", "mopd init: teacher SFT".
  # E.g. --config.profile.stage=mopd --config.profile.start_step=2 --config.profile.num_steps=3
  c.profile = ml_collections.ConfigDict()
  c.profile.stage = ""  # which loop to trace; "" = profiling off
  c.profile.start_step = 2  # earlier steps compile and warm up, so they are left out
  c.profile.num_steps = 3  # traced steps (keep it short: traces grow fast)

  c.smoke = ml_collections.ConfigDict()
  c.smoke.prompts = ("12+34=", "<call>", "f(1)=3")  # texts to complete
  c.smoke.max_new_tokens = 32 if fast else 64  # tokens sampled per smoke prompt
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
