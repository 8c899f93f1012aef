"""The smoke stage: sample from the initial policy (a checkpoint or a fresh init) and print.
The stage takes its `Inputs` (built by `stages/wiring.py`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from mopd_jax import models
from mopd_jax.config import schema as config_mod
from mopd_jax.rollout import sampling
from mopd_jax.stages import sources


@dataclasses.dataclass(frozen=True)
class Inputs:
  """What the smoke stage reads and works with: its config block, the run's seed, the
  tokenizer, the model and the student's params (`policies.initial()`: the policy it samples
  from)."""
  cfg: config_mod.SmokeConfig
  seed: int
  tok: Any
  model_cfg: models.ModelConfig
  policies: sources.Policies


def run(inp: Inputs) -> list:
  """Samples one completion per `smoke.prompts` entry; returns the texts."""
  c, tok = inp.cfg, inp.tok
  params = inp.policies.initial()
  prompts = [[tok.bos_id] + tok.encode(p) for p in c.prompts]
  scfg = sampling.SamplingConfig(max_new_tokens=c.max_new_tokens,
                                 stop_tokens=(tok.eos_id,), pad_id=tok.pad_id)
  out = sampling.sample(inp.model_cfg, params, prompts, rng=jax.random.PRNGKey(inp.seed + 1),
                        scfg=scfg)
  texts = []
  for b, prompt in enumerate(c.prompts):
    gen = [int(t) for t, m in zip(out.tokens[b], out.loss_mask[b]) if m]
    texts.append(tok.decode(gen))
    print(f"[{b}] prompt={prompt!r}\n    sample={texts[-1]!r}  "
          f"({int(out.lengths[b])} tokens, stopped={bool(out.stopped[b])})")
  return texts
