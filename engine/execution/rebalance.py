"""A split redone from the measured stage programs, once, before the first step.

The planner splits on op costs; `Step.profile_programs` then measures what each stage's programs take on the
device. Where a compiler changed stages unevenly, the measured step has a slowest stage the planner did not
see. `rebalance` feeds the measured / planned ratio of every stage back into the cost model
(`engine.planning.measured`), costs the current cuts under it, re-splits the same layout (schedule, stages,
dp, microbatches) under it, and keeps the new split only where it is predicted REBALANCE_GAIN faster; the
Step is then rebuilt on it (`parallelize(rebalance=...)`). Every rank holds the same gathered profile, so every
rank makes the same plan.
"""
from __future__ import annotations

from typing import Callable, Sequence

import attrs

from ..planning.artifacts import Planned
from ..planning.measured import MeasuredScale
from .profile import Profile, measured_scale
from .program import Program

REBALANCE_GAIN = 0.03  # a new split must be predicted this much faster to pay for its compile


@attrs.frozen
class Rebalanced:
    """The re-split plan, the step predicted for the old cuts and for the new under the measured scale."""

    planned: Planned
    cuts_before: tuple[int, ...] = attrs.field(converter=tuple)
    before: float
    after: float
    scale: MeasuredScale

    def __str__(self) -> str:
        return (f"rebalanced from the measured stage programs: cuts {list(self.cuts_before)} -> "
                f"{list(self.planned.plan.cuts)}, predicted step {self.before * 1e3:.2f} -> {self.after * 1e3:.2f} ms "
                f"({self.scale})")


Replan = Callable[..., Planned]  # replan(cuts=..., measured=...): the same layout searched again


def rebalance(planned: Planned, programs: Sequence[Program], profile: Profile, replan: Replan, *,
              gain: float = REBALANCE_GAIN) -> Rebalanced | None:
    """The same layout re-split under the measured scale, or None: nothing to scale (unequal replicas, a
    program not measured), the same cuts, or less than `gain` faster than the current cuts costed alike."""
    plan = planned.plan
    if any(c != 1 for c in plan.replicas):
        return None
    scale = measured_scale(plan, programs, profile)
    if scale is None:
        return None
    kept = replan(cuts=plan.cuts, measured=scale).plan.predicted_step_time
    found = replan(cuts=None, measured=scale)
    if found.plan.cuts == plan.cuts or not found.plan.predicted_step_time < kept * (1 - gain):
        return None
    return Rebalanced(found, plan.cuts, kept, found.plan.predicted_step_time, scale)
