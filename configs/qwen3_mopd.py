"""MOPD with Qwen3 shapes: a Qwen3-0.6B student, nine teachers of Qwen3-1.7B shape.

Run:
    python -m experiments.run --config configs/qwen3_mopd.py --workdir /tmp/mopd_qwen3 \
        --config.model.hf_path=/ckpt/Qwen3-0.6B \
        --config.model.tokenizer_path=/ckpt/Qwen3-0.6B/tokenizer.json
Tiny variant (random Qwen3-shaped model of toy size, char tokenizer; its smoke stage runs on a
2-core CPU, used by the tests):
    python -m experiments.run --config configs/qwen3_mopd.py:tiny --workdir /tmp/mopd_tiny \
        --config.stages=smoke

The student comes from a Hugging Face checkpoint (`model.hf_path`, read by
`mopd_jax.io.hf.load_checkpoint`; empty = the `qwen3-0.6b` preset, randomly initialised). The
teachers are either nine Hugging Face checkpoints (`teacher.hf_paths`, one per cell:
`--config.teacher.hf_paths=gen/low=DIR,gen/high=DIR,...,cod/max=DIR`) or, when empty,
trained by the rl stage as in the toy run (then they share the student's shape).
`mopd_jax.io.hf.resolve_model_config(config.model, vocab_size)` (or `config.teacher`) turns a
block into a ModelConfig.

Stages, in order: data (TFDS builders) -> sft (pi_SFT, QAT) -> rl (3 domains x 3 efforts =
9 frozen teachers) -> mopd (the student) -> eval (pi_SFT, teachers, student on the test
split) -> report (report.json, report.md, PNG plots). `smoke` samples from the student
(the checkpoint, or a freshly initialised model) and prints the samples. Every field not set
here is configs/base.py's default.
"""
import ml_collections

from configs import base

# Shape of the tiny variant: d_model 64, 2 layers, GQA 4:2, QK-norm (Qwen3 family).
_TINY_SHAPE = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   mlp_dim=192, max_seq_len=512, param_dtype="float32", dtype="float32")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: None for the Qwen3 run, "tiny" for random tiny shapes on CPU, "8b" for a
  Qwen3-8B-shape student and nine Qwen3-8B-shape teachers (memory plans, pods)."""
  if arg not in (None, "", "tiny", "8b"):
    raise ValueError(f"unknown config variant {arg!r}; known: tiny, 8b")
  tiny = arg == "tiny"
  big = arg == "8b"
  c = base.get_config()
  # A Qwen3 step (rollouts + update) takes tens of seconds while an async save blocks only
  # for the device->host copy, so every 5 steps costs little and loses at most a few minutes.
  c.checkpoint.every = 1 if tiny else 5

  c.model.preset = "qwen3-0.6b"  # a name from mopd_jax.models.PRESETS
  if tiny:  # overrides of the preset's shape (vocab_size comes from the tokenizer)
    for name, value in _TINY_SHAPE.items():
      setattr(c.model, name, value)
  elif big:
    c.model.preset = "qwen3-8b"
  else:
    c.model.num_layers = 28  # override of the preset's depth (= Qwen3-0.6B's)
    c.model.d_model = 1024  # override of the preset's width (= Qwen3-0.6B's)
  # The 8B student rematerialises each block (with plan.microbatches below).
  c.model.remat = "block" if big else "none"

  c.teacher.preset = "qwen3-8b" if big else "qwen3-1.7b"  # shape of the teachers
  if tiny:  # tiny teachers: the student's shape, twice as deep
    for name, value in _TINY_SHAPE.items():
      setattr(c.teacher, name, value)
    c.teacher.num_layers = 4

  c.mesh.fsdp = 1  # e.g. --config.mesh.fsdp=8 on 8 accelerators

  # benchmarks/memory_plan.py: shapes lowered (never run) on `devices` simulated devices.
  c.plan = ml_collections.ConfigDict()
  c.plan.devices = 64
  c.plan.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=16, tensor=4, teacher=1))
  c.plan.placement = "colocated"  # colocated | disaggregated (then teacher_mesh is used)
  c.plan.teacher_mesh = ml_collections.ConfigDict(dict(data=1, fsdp=8, tensor=1, teacher=1))
  c.plan.accelerator = "TPU v5p" if big else "H100"  # the chip the plan is read against
  c.plan.accelerator_gib = 95.0 if big else 80.0  # its memory per device
  c.plan.num_teachers = 9
  c.plan.rows_per_teacher = 16  # b: the MOPD batch is num_teachers * b rows
  c.plan.seq_len = 2048 if big else 1024  # T: prompt + response tokens per row
  c.plan.prompt_len = 256  # P: prompt bucket of the sampler; decode runs T - P steps
  c.plan.decode_batch = 144  # rows the sampler decodes at once
  # Gradient accumulation of the planned train step (train.OptimConfig.microbatches): the
  # K * b rows in this many equal slices, one optimizer update. Exact; the activations of
  # one slice are live at a time. Each slice must split over the data x fsdp axes (16 here):
  # the 8B step's 144 rows as 9 slices of 16 rows, one row per device (205 -> 47 GiB with
  # remat=block in the plan, see the README).
  c.plan.microbatches = 9 if big else 1

  c.data.sizes = (400, 48, 48) if tiny else (4000, 300, 300)  # train / validation / test

  c.sft.steps = 12 if tiny else 450  # updates; each trains on one domain, round-robin
  c.sft.batch_size = 16 if tiny else 48  # sequences per update
  c.sft.lr = 3e-3 if tiny else 1e-5  # AdamW peak learning rate (warmup + cosine)
  c.sft.warmup_steps = 2 if tiny else 20

  c.rl.steps_per_effort = 2 if tiny else 20  # RL iterations per effort level and domain
  c.rl.prompts_per_step = 4 if tiny else 16  # prompts per iteration
  c.rl.group_size = 2 if tiny else 4  # K samples per prompt
  c.rl.lr = 1e-3 if tiny else 1e-6
  c.rl.loss_args.pmd.token_clip = 5.0  # PMD per-token log-ratio clip (K2.5-style regulariser)

  c.mopd.steps = 3 if tiny else 60  # student updates
  c.mopd.prompts_per_cell = 1 if tiny else 4  # b prompts per (domain, effort) cell per step
  c.mopd.lr = 1e-3 if tiny else 1e-6
  c.mopd.warmup_steps = 0 if tiny else 5
  # Gradient accumulation of the student update, as planned (plan.microbatches above).
  c.mopd.microbatches = 9 if big else 1
  c.mopd.init_samples_per_cell = 8 if tiny else 64  # teacher rollouts per cell (teacher_sft)
  c.mopd.init_sft_steps = 3 if tiny else 60  # SFT updates on them (teacher_sft)
  c.mopd.init_lr = c.sft.lr  # the init fine-tunes pi_SFT at its SFT rate

  c.rollout.max_response_tokens = 96 if tiny else 512  # cap on a response (generated + obs.)
  c.rollout.width = 128 if tiny else 1024  # padded length of train batches (prompt + response)

  c.eval.num_examples = 16 if tiny else 96  # test examples per (domain, effort) cell
  c.rl.validation_examples = 16 if tiny else 96  # each teacher's validation table
  c.smoke.max_new_tokens = 32 if tiny else 64
  return c
