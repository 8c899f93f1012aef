"""The embedded toy config: the whole pipeline on a 2-core CPU.

Run:
    python -m experiments.run --config configs/toy.py --workdir /tmp/mopd_toy
Smoke variant of every stage (used by the tests):
    python -m experiments.run --config configs/toy.py:fast --workdir /tmp/mopd_fast
Override any field from the command line, e.g. `--config.sampling.temperature=0.7`.

Current stages: `smoke` (samples from a freshly initialised model and prints the samples;
a few seconds). Later stages (SFT, RL teachers, MOPD, eval, report) extend this file.
"""
import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: None for the default toy run, "fast" for the smoke variant."""
  if arg not in (None, "", "fast"):
    raise ValueError(f"unknown config variant {arg!r}; known: fast")
  fast = arg == "fast"
  c = ml_collections.ConfigDict()
  c.seed = 0  # every rng in the run is derived from this
  c.stages = "smoke"  # comma-separated subset of stages to run, in pipeline order

  c.model = ml_collections.ConfigDict()
  c.model.preset = "toy"  # a name from mopd_jax.models.PRESETS
  c.model.num_layers = 2 if fast else 4  # override of the preset's depth
  c.model.d_model = 64 if fast else 128  # override of the preset's width

  c.sampling = ml_collections.ConfigDict()
  c.sampling.max_new_tokens = 32 if fast else 64  # generated tokens per rollout, at most
  c.sampling.temperature = 1.0  # 0 = greedy; log-probs are of the sampled distribution
  c.sampling.top_k = 0  # 0 = off
  c.sampling.top_p = 1.0  # 1.0 = off

  c.smoke = ml_collections.ConfigDict()
  c.smoke.prompts = ("12+34=", "<call>", "def f(x):")  # texts to complete
  return c
