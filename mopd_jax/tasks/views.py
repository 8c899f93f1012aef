"""What each party's prompt shows of the reasoning effort: the one place that decides it.

K3 eq. 15 conditions only the student on the effort e: the student's prompt carries e, a
teacher's does not (teacher (d, e) is trained for e, so its effort lives in its weights).
`teacher.effort_in_prompt=True` is an ablation in which the teachers' prompts carry e too.

A `PromptView`, built once from the config's `teacher` block (`Run.view`), answers for
every stage:
  * `student(e)`: the effort the student's prompt carries (always e);
  * `teacher(e)`: the effort a teacher's prompt carries: None in K3's form, e in the
    ablation. RL lanes train the teachers on it, MOPD's teachers score the student's
    rollouts after it, `budget.source=samples` measures b0 with it;
  * `of(policy, e)`: the same for eval's policies ("sft" and "student" see e, "teacher" as
    above);
  * `sft_extra_none` / `sft_choices(efforts)`: what SFT trains on. pi_SFT is where every
    teacher starts, so with effort-free teachers it also trains on effort-free prompts (one
    example in |efforts| + 1 on average), else only on prompts with an effort.

A leaf module: it imports nothing from mopd_jax, so every library module can take a view.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

POLICIES = ("sft", "student", "teacher")


@dataclasses.dataclass(frozen=True)
class PromptView:
  """Which effort each party's prompt carries. `teacher_sees_effort`: False = K3 eq. 15
  (the teachers' prompts carry no effort), True = the ablation in which they do."""
  teacher_sees_effort: bool

  @classmethod
  def from_config(cls, teacher) -> PromptView:
    """The view the config's `teacher` block sets (`teacher.effort_in_prompt`)."""
    return cls(teacher_sees_effort=bool(teacher.effort_in_prompt))

  def student(self, effort: Optional[str]) -> Optional[str]:
    """The effort the student's prompt carries: the effort it is asked for."""
    return effort

  def teacher(self, effort: Optional[str]) -> Optional[str]:
    """The effort the prompt of `effort`'s teacher carries: None (K3 eq. 15), or `effort`
    in the ablation."""
    return effort if self.teacher_sees_effort else None

  def of(self, policy: str, effort: Optional[str]) -> Optional[str]:
    """The effort the prompt of an evaluated `policy` carries at `effort`'s cell: pi_SFT
    and the student as the student sees it, a teacher as it was trained."""
    if policy == "teacher":
      return self.teacher(effort)
    if policy in ("sft", "student"):
      return self.student(effort)
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")

  @property
  def sft_extra_none(self) -> bool:
    """Whether SFT also trains on effort-free prompts: when the teachers, which start from
    pi_SFT, see no effort."""
    return not self.teacher_sees_effort

  def sft_choices(self, efforts: Sequence[str]) -> list:
    """The efforts an SFT example's prompt is drawn from (uniformly) in the "random" effort
    mode: `efforts`, plus None when `sft_extra_none`."""
    return list(efforts) + ([None] if self.sft_extra_none else [])


# K3 eq. 15: the student's prompt carries the effort, the teachers' do not. The library's
# default wherever a dataclass takes a view (`mopd.StepSetup`, `rl.PhaseSampling`,
# `sft.SftDraw`), so the ablation is only ever asked for by name.
K3 = PromptView(teacher_sees_effort=False)
# Every party's prompt carries the effort: the ablation (`teacher.effort_in_prompt=True`).
EFFORT_EVERYWHERE = PromptView(teacher_sees_effort=True)
