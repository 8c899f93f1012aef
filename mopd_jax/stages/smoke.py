"""The smoke stage: sample from the initial policy (a checkpoint or a fresh init) and print."""
from __future__ import annotations

import jax

from mopd_jax import sampling
from mopd_jax.stages.context import Run


def run(ctx: Run) -> list:
  """Samples one completion per `smoke.prompts` entry; returns the texts."""
  c, tok = ctx.config, ctx.tok
  params = ctx.initial_params()
  prompts = [[tok.bos_id] + tok.encode(p) for p in c.smoke.prompts]
  scfg = sampling.SamplingConfig(max_new_tokens=c.smoke.max_new_tokens,
                                 stop_tokens=(tok.eos_id,), pad_id=tok.pad_id)
  out = sampling.sample(ctx.model_cfg, params, prompts, rng=jax.random.PRNGKey(c.seed + 1),
                        scfg=scfg)
  texts = []
  for b, prompt in enumerate(c.smoke.prompts):
    gen = [int(t) for t, m in zip(out.tokens[b], out.loss_mask[b]) if m]
    texts.append(tok.decode(gen))
    print(f"[{b}] prompt={prompt!r}\n    sample={texts[-1]!r}  "
          f"({int(out.lengths[b])} tokens, stopped={bool(out.stopped[b])})")
  return texts
