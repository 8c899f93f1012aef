"""The pipeline: stages chained in order, each a library function of (config, workdir)."""
from __future__ import annotations

import jax
import ml_collections

from mopd_jax import models, sampling
from mopd_jax.tokenizer import CharTokenizer

STAGES = ("smoke",)


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> models.ModelConfig:
  overrides = {k: v for k, v in config.model.items() if k != "preset"}
  return models.get_preset(config.model.preset, vocab_size=vocab_size, **overrides)


def sampling_config(config: ml_collections.ConfigDict, tok) -> sampling.SamplingConfig:
  s = config.sampling
  return sampling.SamplingConfig(max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                 top_k=s.top_k, top_p=s.top_p, stop_tokens=(tok.eos_id,),
                                 pad_id=tok.pad_id)


def smoke(config: ml_collections.ConfigDict, workdir=None) -> list:
  """Sample from a freshly initialised model and print the samples."""
  tok = CharTokenizer()
  cfg = model_config(config, tok.vocab_size)
  params = models.init_params(cfg, jax.random.PRNGKey(config.seed))
  prompts = [[tok.bos_id] + tok.encode(p) for p in config.smoke.prompts]
  rollout = sampling.sample(cfg, params, prompts, jax.random.PRNGKey(config.seed + 1),
                            sampling_config(config, tok))
  texts = []
  for b, prompt in enumerate(config.smoke.prompts):
    gen = [int(t) for t, m in zip(rollout.tokens[b], rollout.loss_mask[b]) if m]
    texts.append(tok.decode(gen))
    print(f"[{b}] prompt={prompt!r}\n    sample={texts[-1]!r}  "
          f"({int(rollout.lengths[b])} tokens, stopped={bool(rollout.stopped[b])})")
  return texts


def run(config: ml_collections.ConfigDict, workdir: str | None = None) -> None:
  stages = [s.strip() for s in config.stages.split(",") if s.strip()]
  unknown = [s for s in stages if s not in STAGES]
  if unknown:
    raise ValueError(f"unknown stage(s) {unknown}; known stages in order: {STAGES}")
  for stage in STAGES:
    if stage in stages:
      globals()[stage](config, workdir)
