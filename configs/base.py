"""The defaults of every run config: each field once, with what it does.

`configs/toy.py` and `configs/qwen3_mopd.py` start from `get_config()` and override only
what differs; `mopd_jax/config/schema.py` turns the result into one typed, checked `RunConfig`
(a field it does not know, or one missing here, is an error), and the pipeline reads every
field from it, with no fallbacks of its own.
Override any field from the command line, e.g. `--config.rl.lr=1e-4`, and the task grid with
`--config.domains=gen,cod --config.efforts=low,max` (names of the `tasks` and `effort`
blocks below; see mopd_jax/tasks/grid.py).
"""
import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg  # the variants live in the configs that build on this one
  c = ml_collections.ConfigDict()
  c.seed = 0  # every rng in the run is derived from this
  c.stages = "data,sft,rl,mopd,eval,report"  # comma-separated subset, run in pipeline order
  # Modules to import before the config is resolved, comma-separated: a loss or a task that
  # registers itself there is then known to the run (docs/walkthrough.md). "" = none.
  c.plugins = ""
  c.log_every = 10  # console / TensorBoard interval in steps
  # JAX's persistent compilation cache for the run's processes (the RL lanes inherit it): a
  # directory, `{workdir}` replaced by the workdir; "" = off. A resumed run reuses what the
  # interrupted one compiled; point two runs at one directory (e.g. ~/.cache/mopd_jax/xla)
  # and the second reuses the first's. A JAX_COMPILATION_CACHE_DIR in the environment wins.
  c.compile_cache = "{workdir}/xla_cache"
  # A step whose loss or gradient norm is not finite is never applied. False: stop with a
  # message naming the step and the metric; True: skip such steps and count the skips.
  c.skip_nonfinite = False

  # The task grid: one teacher per (domain, effort) cell. `domains` and `efforts` name
  # blocks of `tasks` and `effort`, comma-separated, in the order tables list them.
  c.domains = "gen,agt,cod"
  c.efforts = "low,high,max"
  # Per domain: the registered task it runs (mopd_jax.tasks; a domain that is itself a
  # registered task's name needs no block).
  c.tasks = ml_collections.ConfigDict({d: {"task": d} for d in ("gen", "agt", "cod")})
  # Per effort: its budget multiplier; the budget of example x is floor(tau * b0(x)) tokens.
  # The RL lanes anneal from the largest tau down.
  c.effort = ml_collections.ConfigDict({"low": {"tau": 0.25}, "high": {"tau": 0.55},
                                        "max": {"tau": 1.0}})

  # Per-step checkpoints of every training loop (orbax, last 2 complete steps kept, saved
  # asynchronously). A SIGTERM always saves the step it interrupts; the interval bounds what
  # a SIGKILL or crash loses.
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 10  # steps between saves

  c.model = ml_collections.ConfigDict()
  c.model.preset = "toy"  # a name from mopd_jax.models.PRESETS
  c.model.hf_path = ""  # student checkpoint dir (config.json + safetensors); empty = the preset
  c.model.tokenizer_path = ""  # a tokenizer.json; empty = the toy CharTokenizer
  c.model.quant = "int4"  # QAT from SFT on: none | int8 | int4 (group-wise)
  c.model.quant_group = 32  # weights per quantisation group
  # Activation rematerialisation of the training forward: none | block (jax.checkpoint per
  # transformer block, saving nothing) | dots (saving the weight-matmul outputs). Exact; it
  # trades recompute for memory.
  c.model.remat = "none"

  # Teachers: trained by the rl stage from pi_SFT (the default), or brought as Hugging Face
  # checkpoints, one per cell of the grid: "gen/low=DIR,gen/high=DIR,..." (every cell, no
  # other).
  c.teacher = ml_collections.ConfigDict()
  c.teacher.hf_paths = ""
  # K3 eq. 15 conditions the student on the effort and not the teacher, whose effort lives
  # in its weights: False = teachers are trained (RL), initialise the student (teacher_sft)
  # and score MOPD rollouts on prompts without the effort, the student's prompts carry it.
  # True = every prompt carries it (an ablation). pi_SFT, the teachers' start, trains on
  # both: with False, one SFT example in |efforts| + 1 has no effort (docs/choices.md).
  c.teacher.effort_in_prompt = False
  # Outside-teacher ablation (configs/toy_outside_teacher.py): "domain/effort" of a cell
  # whose teacher is trained from a second SFT of `outside_seed`; "" = off.
  c.teacher.outside_cell = ""
  c.teacher.outside_seed = 1
  # Teacher servers (python -m mopd_jax.serve, or vLLM with --served-model-name CELL): the MOPD
  # stage scores against them instead of in-process. "gen/low=http://h1:8000|http://h2:8000,
  # gen/max=..." maps every cell to one URL or several replicas; "" = in-process teachers. A
  # URL may declare its engine ("sglang+http://h:30000", vllm+, mopd+); else it is detected.
  c.teacher.endpoints = ""
  c.teacher.endpoint_timeout_s = 60.0  # per scoring request
  c.teacher.endpoint_retries = 4  # tries after the first (backoff, failover), then the run stops
  # The parity probe at start (mopd_jax/teachers/parity.py): each replica of each cell's
  # server must score a probe set within this mean |delta log p| per token of the in-process
  # teacher (where the run holds the teachers' params; else of the cell's first replica), or
  # the run stops before its first step.
  # 0 = the default of the servers' compute dtype (`server_dtype`: float32 0.01, bfloat16
  # 0.2; mopd_jax/config/schema.py PARITY_TOLERANCE, measured in docs/teacher_server.md).
  c.teacher.parity_tolerance = 0.0
  c.teacher.server_dtype = "float32"
  # The probe again every this many MOPD steps, every replica of every cell against the
  # probe's reference at start: a drifting server stops the run after a checkpoint (one
  # `teacher error:` line, exit 3); each probe's gaps are in the step's metrics. 0 = at
  # start only.
  c.teacher.probe_every = 20
  # An environment variable holding the servers' API key, sent as "Authorization: Bearer
  # <key>" (vllm serve --api-key; python -m mopd_jax.serve --api_key_env); "" = none.
  c.teacher.api_key_env = ""
  # Teachers of another tokenizer (docs/cross_tokenizer.md): the tokenizer.json (or its
  # directory) every `teacher.hf_paths` checkpoint uses; "" = the student's. Each teacher
  # scores the student's response re-encoded in its tokens after its own prompt, and a span's
  # clipped log-ratio reaches the student's tokens of the span: `spread` evenly (r_j / n_j
  # each) or on its `last` token.
  c.teacher.tokenizer_path = ""
  # Cells whose teacher reads yet another tokenizer ("domain/effort=TOKENIZER,..."; the others
  # read `tokenizer_path`): teachers of several families in one run, each family (tokenizer
  # and model shape) stacked in a bank of its own, in this process.
  c.teacher.tokenizer_paths = ""
  c.teacher.span_reward = "spread"
  # mopd.loss='char_kl' with teacher.endpoints: the servers' top-k next tokens read at each
  # position (vLLM's default --max-logprobs is 20); the mass past them is left out.
  c.teacher.served_top_k = 20

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # mesh axis sizes; their product must equal the device count
  c.mesh.fsdp = 1  # splits the batch and also the params (their embed dimension)
  c.mesh.tensor = 1  # splits attention heads, MLP columns and the vocabulary
  c.mesh.teacher = 1  # co-located placement: splits the stacked teacher bank over slices

  # Teacher placement (mopd_jax/teachers/placement.py): colocated = the bank shares the student's
  # devices (the mesh's `teacher` axis splits the stacked bank); disaggregated = the bank
  # lives on its own sub-mesh of the last devices, `teacher_mesh`, and trajectories and
  # log-probs move between the two with jax.device_put.
  c.placement = ml_collections.ConfigDict()
  c.placement.teachers = "colocated"
  c.placement.teacher_mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1,
                                                            teacher=1))

  # Multi-host (jax.distributed). Empty / 0 / -1 = take the value from the environment
  # (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) or let JAX detect it
  # (TPU pods, SLURM); with none of them set the run stays single-process.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""  # "host:port" of process 0
  c.distributed.num_processes = 0
  c.distributed.process_id = -1
  c.distributed.initialize = False  # True: always call jax.distributed.initialize (pods)

  c.data = ml_collections.ConfigDict()
  c.data.sizes = (4000, 300, 300)  # train / validation / test examples per domain
  c.data.dir = ""  # TFDS data_dir; empty = <workdir>/data
  # Domains of record files (task "records"): a prompt longer than this many tokens (as the
  # student sees it) is skipped and counted, or stops the data stage (on_too_long="error");
  # nothing is truncated. 0 = no limit.
  c.data.max_prompt_tokens = 0
  c.data.on_too_long = "skip"

  # b0(x) of record domains: "reference" = the toy's rule on the reference response's
  # tokens (1.1 x (tokens + EOS)); "field" = the record's positive-int `budget`; "samples" =
  # 1.1 x the tokens of the shortest correct response among `samples` samples of pi_SFT at
  # the top effort, measured at the start of the rl stage (mopd_jax/tasks/budgets.py). A record
  # whose b0 cannot be set is dropped and counted.
  c.budget = ml_collections.ConfigDict()
  c.budget.source = "reference"
  c.budget.samples = 4
  # The tokens a response is counted in against its budget: "" = the run's own tokenizer;
  # "char" = the toy's character tokenizer (the toy tasks' b0 is in characters), or a
  # tokenizer.json. A teacher factory of another tokenizer counts in its student's tokens,
  # so its teachers keep the student's budgets (docs/cross_tokenizer.md).
  c.budget.count_with = ""

  # How a prompt becomes tokens (mopd_jax/io/tokenizer.py). With a Hugging Face tokenizer that
  # has a chat template (and chat_template=True) the prompt is a user message; the student's
  # effort is its special token after the generation prompt (effort_format="token"), a
  # system message (`system_line`, "system"), that line at the start of the user's turn
  # ("user"), or "auto": "system" where the template has a system role, else "user" (no
  # token added but with "token"). The toy's CharTokenizer ignores these. Empty token names
  # = the ones the tokenizer's own files name (tokenizer_config.json, special_tokens_map.json,
  # generation_config.json; with a chat template the end of a response is the token ending
  # an assistant's turn), else <pad> <bos> <eos> added. tool_tokens: four existing tokens
  # (call, call end, observation, observation end) for the tool markers, used when a domain
  # of the run uses tools; empty = the markers its data writes (records: <tool_call>
  # </tool_call> <tool_response> </tool_response>; the toy's agt: <call> </call> <obs>
  # </obs>), the tokenizer's own when it has them, else added.
  c.prompt = ml_collections.ConfigDict()
  c.prompt.chat_template = True
  c.prompt.effort_format = "token"
  c.prompt.system_line = "Reasoning effort: {effort}"
  c.prompt.pad_token = ""
  c.prompt.bos_token = ""
  c.prompt.eos_token = ""
  c.prompt.tool_tokens = ""

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 1000  # updates; each trains on one domain (sft.schedule)
  # The repeating sequence of domains, one per update; empty = round-robin over `domains`.
  # Domains outside the run's grid are dropped from it.
  c.sft.schedule = ""
  # Per domain, the weights of the reference styles (full, brief, direct) in SFT data; a
  # domain not named draws them uniformly.
  c.sft.style_weights = ml_collections.ConfigDict()
  c.sft.batch_size = 48  # sequences per update
  c.sft.lr = 3e-3  # AdamW peak learning rate (warmup + cosine)
  c.sft.warmup_steps = 20  # linear warmup before the cosine decay
  c.sft.weight_decay = 0.0  # AdamW's decoupled weight decay
  # Gradient accumulation (train.OptimConfig.microbatches): each update's rows in this many
  # equal slices, one slice's activations alive at a time; the same update, exactly.
  c.sft.microbatches = 1
  c.sft.effort_mode = "random"  # effort token of SFT examples: random | style (see sft.py)

  c.rl = ml_collections.ConfigDict()
  c.rl.loss = "pmd"  # pmd (Kimi K1.5/K2 policy mirror descent) | grpo (clipped ratio)
  # Each loss's own hyperparameters (its `LossKind.args`), a block per loss of the stage: the
  # run reads the block of the loss it trains with, and a block of another loss must keep its
  # defaults. A plugin loss's config file adds its block.
  c.rl.loss_args = ml_collections.ConfigDict()
  c.rl.loss_args.pmd = dict(token_clip=0.0)  # per-token log-ratio clip (K2.5 style); 0 = off
  # The clipped ratio [1 - eps_low, 1 + eps_high] ("clip-higher") and the log-ratio's clip.
  c.rl.loss_args.grpo = dict(eps_low=0.2, eps_high=0.28, log_ratio_clip=20.0)
  c.rl.steps_per_effort = 20  # RL iterations of the first (largest-tau) effort phase
  c.rl.prompts_per_step = 16  # prompts per iteration
  c.rl.group_size = 4  # K samples per prompt
  c.rl.microbatches = 1  # gradient accumulation; slices must hold whole groups
  # Length groups (train.OptimConfig.length_groups): each update's rows sorted by length into
  # this many equal groups (whole groups of K rows), each padded only as far as its longest
  # row; the same update up to float reassociation, fewer padded tokens, one more compiled
  # program per group shape (docs/performance.md). 1 = off.
  c.rl.length_groups = 1
  # PMD's old policy: one value for every phase, two (first phase, budget phases) or one per
  # phase. "sampler" (the policy that sampled the batch, one update old) | "sft" (the lane's
  # pi_SFT, held fixed) | "parent" (the effort's parent teacher, held fixed).
  c.rl.reference = "sampler"
  # Which policy draws the samples of a phase whose old policy is held fixed ("sft",
  # "parent"): "policy" (the one being trained) | "reference" (that old policy, as Kimi
  # K1.5's policy mirror descent has it; mopd_jax/training/rl.py SAMPLE_FROM). Phases with the
  # "sampler" old policy draw from the policy either way.
  c.rl.sample_from = "policy"
  c.rl.lr = 3e-4  # AdamW learning rate of the first phase (cosine over each phase's steps)
  c.rl.tau_kl = 0.5  # PMD log-ratio weight of the first phase
  # The budget phases after the first; 0 = as the first phase.
  c.rl.anneal_lr = 0.0
  c.rl.anneal_tau_kl = 0.0
  c.rl.anneal_steps = 0
  # Reward-plateau stopping rule of every phase, on top of the step count: stop once the
  # mean sample reward of the last `plateau_window` steps is less than `plateau_delta` above
  # that of the window before; 0 = off.
  c.rl.plateau_window = 0
  c.rl.plateau_delta = 0.02
  c.rl.temperature = 1.0  # sampling temperature of RL rollouts
  # Validation prompts each teacher is evaluated on when its phase ends (greedy, capped at
  # the split's size): the rl stage's teacher table and `teachers.json`; nothing downstream
  # reads it (the eval stage measures every teacher on the test split).
  c.rl.validation_examples = 96
  # Lanes side by side, each in a process of its own (mopd_jax/stages/lanes.py), or 1: one after
  # another in this process. Same teachers either way; on one accelerator use 1.
  c.rl.lane_processes = 1
  # Partial rollouts in the RL lanes (mopd_jax/rollout/partial.py; as mopd.partial_rollout_tokens):
  # a step decodes at most this many more tokens of every in-flight sample and trains on the
  # prompts whose samples are all complete; 0 = off. `partial_mode`: "recompute" (earlier
  # segments' sampler log-probs recomputed under the policy being updated, PMD's "sampler"
  # old policy included) | "importance" (kept: PMD's and the clipped ratio's old policy).
  c.rl.partial_rollout_tokens = 0
  c.rl.partial_mode = "recompute"

  c.mopd = ml_collections.ConfigDict()
  c.mopd.steps = 100  # student updates
  c.mopd.prompts_per_cell = 4  # b prompts per (domain, effort) cell per step
  # distinct: each cell of a domain gets its own prompts | shared: the domain's b prompts are
  # posed at every effort, so the efforts' updates differ by the effort token alone.
  c.mopd.prompts_across_efforts = "distinct"
  # Effort mix (distinct only): weights of the efforts in `efforts` order; each prompt's
  # effort is drawn from them, so cells vary in size from step to step (the teachers' batch
  # is padded to the largest possible cell). () = prompts_per_cell prompts in every cell.
  c.mopd.effort_mix = ()
  c.mopd.lr = 1e-3  # AdamW peak learning rate of the student
  c.mopd.warmup_steps = 5  # linear warmup before the cosine decay
  c.mopd.microbatches = 1  # gradient accumulation (also of the teacher_sft init)
  c.mopd.length_groups = 1  # length groups (see rl.length_groups; also of the init)
  c.mopd.r_max = 5.0  # clip of the per-token reward r_t (K3 eq. 15)
  # Temperature of the teachers' log-probs in r_t: 1 = K3 eq. 15 as written; < 1 sharpens
  # each teacher towards its greedy behaviour (what the eval measures).
  c.mopd.teacher_temperature = 1.0
  # A loss registered for the mopd stage (mopd_jax/training/registry.py): mopd (eq. 15) | pg
  # (clipped ratio, reward as advantage) | topk (ablation: reverse KL on the routed teacher's
  # top_k tokens at each position, corrected for the truncation) | vocab_kl | outcome |
  # char_kl (teachers of another tokenizer, a character-level student:
  # docs/cross_tokenizer.md), or a plugin's (`plugins`)
  c.mopd.loss = "mopd"
  # Each loss's own hyperparameters (`LossKind.args`), a block per loss as for rl.loss_args;
  # a loss without a block takes its args' defaults.
  c.mopd.loss_args = ml_collections.ConfigDict()
  c.mopd.loss_args.pg = dict(eps_low=0.2, eps_high=0.28, log_ratio_clip=20.0)
  c.mopd.loss_args.topk = dict(k=8)  # teacher tokens per position
  # The weight of the future-KL term, which charges each sampled token with the exact KL of
  # the rest of its rollout (mopd_jax/training/vocab_kl.py `future_kl_term`); 0 = off;
  # future_baseline: that KL less its cell's leave-one-out mean at the same position; clip:
  # the gradient as eq. 15's expectation with its reward clipped at mopd.r_max; per: "row"
  # (eq. 15's 1/|y|) or "token" (a mean over the batch's tokens). Each measured not to
  # lower the toy's held-out KL (docs/toy_results.md).
  c.mopd.loss_args.vocab_kl = dict(future_kl=0.0, future_baseline=False, clip=False,
                                     per="row")
  # Weight of the outcome-reward term: alpha * (verifier reward - its (domain, effort)
  # cell's batch mean) on every generated token, REINFORCE; 0 = pure distillation.
  c.mopd.alpha = 0.0
  # Teacher scoring one step behind sampling: 0 = synchronous; 1 = the teachers score batch
  # k while the student samples batch k+1 (worth it with placement "disaggregated"). The
  # one-update-stale batch is trained with truncated importance weights
  # clip(pi_theta / pi_sampler, *is_bounds) on every token.
  c.mopd.staleness = 0
  c.mopd.is_bounds = (0.5, 2.0)
  # Partial rollouts (mopd_jax/rollout/partial.py): a step decodes at most this many more tokens of
  # every in-flight trajectory; unfinished ones carry over to the next step, and only
  # complete trajectories enter the loss. 0 = off (each step decodes its rollouts to the
  # end). `partial_mode`: how the earlier segments, drawn by older students, are treated:
  # "recompute" (their log-probs recomputed under the current student: on-policy) |
  # "importance" (the loss weighs tokens by clip(pi_now / pi_drawn, *is_bounds)).
  c.mopd.partial_rollout_tokens = 0
  c.mopd.partial_mode = "recompute"
  # Student initialisation: sft (pi_SFT, as the MOPD paper assumes) | teacher_sft (pi_SFT
  # further fine-tuned on trajectories of every teacher, each with its effort token).
  c.mopd.init = "sft"
  # The student's start: pi_SFT with its logits divided by this (its final RMSNorm scale
  # divided, `models.with_temperature`), before the init and the steps; 1 = pi_SFT as
  # trained. Teachers scored at mopd.teacher_temperature T < 1 are their own policies
  # sharpened by 1/T, a global logit scale that Adam's per-parameter steps move by at most
  # the rate per update; starting the student at T puts it on the same footing.
  c.mopd.start_temperature = 1.0
  c.mopd.init_samples_per_cell = 64  # teacher rollouts per cell (teacher_sft)
  c.mopd.init_sft_steps = 60  # SFT updates on them (teacher_sft)
  # The teacher-SFT init fine-tunes pi_SFT: its AdamW peak rate and linear warmup (then
  # cosine decay over init_sft_steps).
  c.mopd.init_lr = 3e-3
  c.mopd.init_warmup_steps = 0
  # What the init fits at each position of a teacher trajectory: "tokens" (SFT on the token
  # the teacher sampled) | "distribution" (the forward KL(teacher || student) over the
  # teacher's init_top_k most likely tokens at its scoring temperature; 0 = the whole
  # vocabulary), computed once per pool row and kept on the host.
  c.mopd.init_target = "tokens"
  c.mopd.init_top_k = 0
  # Every this many steps, the exact per-token KL(student || routed teacher) over the whole
  # vocabulary (chunked; one more forward of the student and the teachers) beside the
  # sampled-token estimate; the report's KL plot uses it. 0 = off; co-located teachers only.
  c.mopd.exact_kl_every = 10

  c.rollout = ml_collections.ConfigDict()
  c.rollout.max_response_tokens = 96  # hard cap on a response (generated + observations)
  c.rollout.max_turns = 4  # tool calls per agt trajectory
  # Least padded length of RL train batches (prompt + response); a batch is padded to the
  # power of two holding its longest trajectory.
  c.rollout.width = 64
  # Decode weights, activations and KV cache of every rollout: float32 (the sampler's
  # log-probs equal fp32 teacher forcing within 1e-5) | bfloat16 (faster on accelerators;
  # the sampler's log-probs, which PMD's "sampler" old policy and the staleness importance
  # weights use, carry bf16 rounding: ~2e-2 at most on the benchmark shape; the losses
  # recompute the policy's own log-probs in fp32). docs/performance.md.
  c.rollout.sampling_dtype = "float32"
  # Continuous batching (mopd_jax/rollout/continuous.py): this many decode slots, refilled from the
  # call's queue of rows as rows finish, so rows of very different lengths keep the batch
  # full; every row's tokens are those of the static sampler. 0 = the static sampler (each
  # call's rows decode as one batch until its longest row stops). `admission`: the order
  # waiting rows take free slots, "longest_cap_first" (rows with the largest remaining
  # budget first) | "fifo". docs/performance.md.
  c.rollout.decode_slots = 32
  c.rollout.admission = "longest_cap_first"

  # The code sandbox of code verifiers (mopd_jax/tasks/sandbox.py). backend: "auto"
  # (bubblewrap where it works, else the in-process barrier with a loud warning) | "bwrap" |
  # "inprocess"; `workers` programs run at once; per-program wall-clock and memory limits.
  c.sandbox = ml_collections.ConfigDict()
  c.sandbox.backend = "auto"
  c.sandbox.workers = 2
  c.sandbox.timeout_s = 2.0
  c.sandbox.memory_mb = 256

  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 96  # test examples per (domain, effort) cell
  c.eval.temperature = 0.0  # 0 = greedy
  # Besides the greedy accuracy: the mean accuracy of `samples` sampled responses per test
  # example at `sample_temperature` (0 = off; costs `samples` more rollouts per cell).
  c.eval.samples = 0
  c.eval.sample_temperature = 1.0
  # pi_SFT's and the student's held-out log-ratio to each cell's teacher
  # (mopd_jax/evaluation/agreement.py): the mean per-token log pi - log pi_T along their greedy test
  # answers, scored like the MOPD stage's (in process, or by the `teacher.endpoints`
  # servers). One teacher-forced forward of the policy and one teacher prefill per batch.
  c.eval.teacher_logratio = False
  # The exact per-token KL(policy || routed teacher) over the whole vocabulary, as the MOPD
  # stage measures it, for pi_SFT and the student on their own rollouts (temperature 1) of
  # the first `kl_rollouts` test prompts of each domain at every effort (0 = off): the
  # report's KL drop is pi_SFT's over the student's, each with its standard error
  # (mopd_jax/evaluation/agreement.py). Needs the teachers' params in this process.
  c.eval.kl_rollouts = 0

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
  c.smoke.max_new_tokens = 64  # tokens sampled per smoke prompt
  return c
