"""A split redone from the measured stage programs, once, before the first step.

The planner splits on op costs; `Step.profile_programs` then measures what each stage's programs take on the
device. Where a compiler changed stages unevenly, the measured step has a slowest stage the planner did not
see. `rebalance` feeds the measured / planned ratio of every stage back into the cost model
(`engine.planning.measured`), re-splits the same layout (schedule, stages, dp, microbatches) under it, and keeps
the new split only where it is predicted REBALANCE_GAIN faster than the running step's own prediction from its
measured programs; the Step is then rebuilt on it (`parallelize(rebalance=...)`, which asks twice: a proposal
from the first measurement is made again from the faster of two measurements of each program). Every rank
holds the same gathered profile, so every rank makes the same plan (parallelize checks that before it closes
the step).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import attrs

import schedules

from ..errors import PlanError, SplitError
from ..planning.artifacts import Planned
from ..planning.measured import MeasuredScale
from .profile import Profile, measured_scale, predicted_step_time
from .program import Program

log = logging.getLogger("engine.runtime")

REBALANCE_GAIN = 0.03  # a new split must be predicted this much faster to pay for its compile


@attrs.frozen
class Rebalanced:
    """The re-split plan; the running step's predicted time (its measured programs simulated), the new split's
    under the measured scale, and, once the new step's programs are measured, its own (`measured_after`)."""

    planned: Planned
    cuts_before: tuple[int, ...] = attrs.field(converter=tuple)
    before: float
    after: float
    scale: MeasuredScale
    measured_after: float | None = None

    def __str__(self) -> str:
        then = "" if self.measured_after is None else f", {self.measured_after * 1e3:.2f} ms from its measured programs"
        return (f"rebalanced from the measured stage programs: cuts {list(self.cuts_before)} -> "
                f"{list(self.planned.plan.cuts)}, predicted step {self.before * 1e3:.2f} -> {self.after * 1e3:.2f} ms"
                f"{then} ({self.scale})")


Replan = Callable[..., Planned]  # replan(measured=...): the same layout searched again under the scale
REPLAN_ERRORS = (PlanError, SplitError, schedules.ScheduleError)  # a re-split that fails keeps the running one


def rebalance(planned: Planned, programs: Sequence[Program], profile: Profile, replan: Replan, *,
              gain: float = REBALANCE_GAIN) -> Rebalanced | None:
    """The same layout re-split under the measured scale, or None: nothing to re-split (one stage, unequal
    replicas, a program not measured), the same cuts, no split that fits, or a split less than `gain` faster
    than the running step's prediction from its measured programs (what runs, in the order that runs)."""
    plan = planned.plan
    if plan.num_stages == 1 or any(c != 1 for c in plan.replicas):
        return None
    scale = measured_scale(plan, programs, profile)
    now = predicted_step_time(plan, planned.table, programs, profile)
    if scale is None or now is None:
        return None
    try:
        found = replan(measured=scale)
    except REPLAN_ERRORS as err:
        log.warning("rebalance: no re-split under the measured stage times (%s: %s); the planner's cuts stay",
                    type(err).__name__, err)
        return None
    if found.plan.cuts == plan.cuts or not found.plan.predicted_step_time < now * (1 - gain):
        return None
    return Rebalanced(found, plan.cuts, now, found.plan.predicted_step_time, scale)
