"""A small MOPD batch for the exact-KL tests: a student, two deeper teachers of (gen/low,
gen/max) and five rollouts of random tokens, laid out as the MOPD stage lays them out
(`mopd.SampledBatch`), with the teachers' view with or without the effort."""
import types

import numpy as np

NAMES = ("gen/low", "gen/max")
EFFORTS = ("low", "max", "max", "low", "max")


def random_rollouts(effort_free: bool, *, quant: str = "int4") -> types.SimpleNamespace:
  import jax
  import jax.numpy as jnp
  from mopd_jax import models
  from mopd_jax.io.tokenizer import CharTokenizer
  from mopd_jax.rollout import turns as rollout
  from mopd_jax.tasks import get_task
  from mopd_jax.teachers import bank as teachers
  from mopd_jax.training import mopd
  tok = CharTokenizer()
  s_cfg = models.get_preset("toy", vocab_size=tok.vocab_size, num_layers=1, d_model=32,
                            quant=quant, quant_group=16)
  t_cfg = s_cfg.replace(num_layers=2, quant="none")
  student = models.init_params(s_cfg, jax.random.PRNGKey(1))
  bank = teachers.build_bank(t_cfg, {n: models.init_params(t_cfg, jax.random.PRNGKey(5 + i))
                                     for i, n in enumerate(NAMES)})
  exs = get_task("gen").generate(0, len(EFFORTS))
  rng = np.random.RandomState(0)
  trajs = []
  for ex, e in zip(exs, EFFORTS):
    ids = rng.randint(20, 60, size=rng.randint(3, 9)).tolist() + [tok.eos_id]
    trajs.append(rollout.Trajectory(rollout.encode_prompt(tok, ex, e), ids, [1] * len(ids),
                                    [0.0] * len(ids), True))
  arr = rollout.pad_batch(trajs, tok.pad_id, 64)
  t_arr, spans = mopd.teacher_view(tok, trajs, exs) if effort_free else (arr, None)
  tid = np.asarray([NAMES.index(f"gen/{e}") for e in EFFORTS])
  index = teachers.stratify(tid, 2, 3)
  strat = lambda x, fill=0: jnp.asarray(teachers.gather_stratified(x, index, fill))
  n = len(trajs)
  sampled = mopd.SampledBatch(arr=arr, index=index, tokens=strat(t_arr["tokens"]),
                              input_mask=strat(t_arr["input_mask"], False), cell_ids=tid,
                              accuracy=np.zeros(n), lengths=np.asarray([t.num_tokens
                                                                        for t in trajs]),
                              over=np.zeros(n, bool), spans=spans)
  return types.SimpleNamespace(s_cfg=s_cfg, t_cfg=t_cfg, student=student, bank=bank,
                               sampled=sampled, trajs=trajs, arr=arr, t_arr=t_arr,
                               spans=spans, tid=tid)
