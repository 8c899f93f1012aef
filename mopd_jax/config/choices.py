"""The named choices of the run config that algorithm modules also switch on.

A leaf module: it imports nothing from mopd_jax, so `mopd_jax.config.schema` (the schema) and the
modules that act on these values both import it without the schema importing an algorithm.
"""

# Mesh axes, in the order of a mesh's dimensions (mopd_jax/runtime/sharding.py).
MESH_AXES = ("data", "fsdp", "tensor", "teacher")
# Where the teachers run: on the student's devices or on a sub-mesh of their own
# (mopd_jax/teachers/placement.py).
PLACEMENTS = ("colocated", "disaggregated")
# What a record domain does with a prompt over `data.max_prompt_tokens` (mopd_jax/tasks/base.py).
ON_TOO_LONG = ("error", "skip")
# Where the student's effort goes in its prompt (mopd_jax/io/tokenizer.py: HFTokenizer).
EFFORT_FORMATS = ("token", "system", "user", "auto")
# How partial rollouts that span policy versions are trained on (mopd_jax/rollout/partial.py).
PARTIAL_MODES = ("recompute", "importance")
# mopd.loss: K3 eq. 15's sampled-token log-ratio, its clipped-ratio PG form, the routed
# teacher's top-k, the exact KL over the whole vocabulary (`vocab_kl.py`), and RL on the
# verifiers' outcome alone (`outcome`, with mopd.alpha > 0: the ablation's RL row).
# Whether a MOPD step's efforts draw distinct prompts or share them (mopd_jax/training/mopd.py).
PROMPT_MODES = ("distinct", "shared")
# What the teacher-SFT init fits at each position of a teacher's trajectory: the token the
# teacher sampled (SFT) or the teacher's next-token distribution (forward KL on its top-k).
INIT_TARGETS = ("tokens", "distribution")
