"""Ablation: one teacher from outside the student's family (K3 §4.1.3's "outside" teacher).

Run:
    python -m experiments.run --config configs/toy_outside_teacher.py --workdir /tmp/mopd_out
    python -m experiments.run --config configs/toy_outside_teacher.py:fast --workdir /tmp/o_fast

Everything is configs/toy.py (same variants: "", "fast", "tiny") except one teacher cell,
`teacher.outside_cell`: its teacher is trained from a second SFT with its own seed
(`teacher.outside_seed`: another initialisation, data order and effort-token draw), then
through that cell's RL anneal (max -> ... -> its effort), instead of from the student's
pi_SFT. The other eight teachers and the student are as in the toy run.

What to read in the report: `kl.initial_by_cell` (report.json) and the per-teacher table
(report.md) give the per-token KL student vs routed teacher at the first MOPD step with each
teacher's origin, `kl.initial_by_origin` their means ("same" vs "outside"); the student's
scores in the outside cell are in `cells`.
"""
import ml_collections

from configs import toy


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = toy.get_config(arg)
  c.teacher.outside_cell = "gen/max"  # "domain/effort" of the replaced teacher
  c.teacher.outside_seed = c.seed + 1  # seed of the outside SFT; must differ from c.seed
  return c
