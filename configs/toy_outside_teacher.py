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
teacher's origin, `kl.initial_by_origin` their means ("same" vs "outside"),
`kl.outside_vs_same` the validation accuracies of the outside teacher and of the same-origin
teacher it replaces (a check: within 10 points); the student's scores in the outside cell are
in `cells`.
"""
import ml_collections

from configs import toy


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = toy.get_config(arg)
  # "domain/effort" of the replaced teacher. cod/max: the seed-1 SFT learns cod's full style
  # (its cod/max teacher is as accurate as seed 0's), so the ablation compares teachers of
  # similar quality and differing origin; seed 1's SFT does not learn gen's full style (see
  # configs/toy.py, sft.schedule), and an outside gen/max teacher would mix origin with
  # quality. The report checks the two teachers' validation accuracies are within 10 points.
  c.teacher.outside_cell = "cod/max"
  c.teacher.outside_seed = c.seed + 1  # seed of the outside SFT; must differ from c.seed
  return c
