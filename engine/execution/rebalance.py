"""A split redone from the measured stage programs, once, before the first step.

The planner splits on op costs; `Step.profile_programs` then measures what each stage's programs take on the
device. Where a compiler changed stages unevenly, the measured step has a slowest stage the planner did not
see. `rebalance` feeds the measured / planned ratio of every stage back into the cost model
(`engine.planning.measured`, refitted per kind of block by `engine.planning.tied`), re-splits the same layout
(schedule, stages, dp, microbatches) under it, and keeps the new split only where it is predicted REBALANCE_GAIN
faster than the running split costed the same way (both cuts costed by the planner's fixed-cuts path under the
scale: the free search's searched order is not compared with the fixed order of the other cuts, which on a small
zbv MLP alone differ by 3 %); the Step is then rebuilt on it (`parallelize(rebalance=...)`, which asks twice: a
proposal from the first measurement is made again from the faster of two measurements of each program). Every rank
holds the same gathered profile, so every rank makes the same plan (parallelize checks that before it closes
the step).

`rebalance="step"` takes the stage times from inside steps instead (`in_steps`: traced steps on the example
batch, each program's median from its inputs' arrival to its end): on 4 x H100 (2026-11-26, zbv, GPT and Llama)
programs ran 1.01-1.24 x their in-turn times inside the step, unevenly by stage (the first and last stages'
embedding and head least), so a split balanced on in-turn times is not balanced in the step. The new split is
kept only if its own traced steps run faster than the running step's.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensor

import schedules

from ..errors import PlanError, SplitError
from ..planning.artifacts import Planned
from ..planning.measured import MeasuredScale
from .profile import Profile, from_spans, measured_scale, predicted_step_time
from .program import Program

log = logging.getLogger("engine.runtime")

REBALANCE_GAIN = 0.01  # a new split must be predicted this much faster than the running one, costed alike
# (1 %, not the 3 % of sessions 11-22: those compared a model's prediction with a simulation of the measured
# programs, whose gap alone could reach 3 %; a re-split whose measured programs predict no faster step is
# undone, so a wrong call costs one compile; on session 23's first Llama launch at p = 4 the split the tied
# model finds was costed 1.9 % faster alike and 3.2 % by the free search's order: benchmarks/NOTES.md)


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
    stepped: tuple[float, float] | None = None  # rebalance="step": traced step seconds, running split -> new one
    costed: tuple[float, float] | None = None  # the running cuts and the new ones under the scale, costed alike

    def __str__(self) -> str:
        then = "" if self.measured_after is None else f", {self.measured_after * 1e3:.2f} ms from its measured programs"
        if self.stepped is not None:
            then += f"; traced steps {self.stepped[0] * 1e3:.2f} -> {self.stepped[1] * 1e3:.2f} ms"
        if self.costed is not None:
            then += f"; costed alike {self.costed[0] * 1e3:.2f} -> {self.costed[1] * 1e3:.2f} ms"
        source = "the stage programs inside steps" if self.stepped is not None else "the measured stage programs"
        return (f"rebalanced from {source}: cuts {list(self.cuts_before)} -> "
                f"{list(self.planned.plan.cuts)}, the running step's programs {self.before * 1e3:.2f} ms, the new "
                f"split's own prediction {self.after * 1e3:.2f} ms{then} ({self.scale})")


Replan = Callable[..., Planned]  # replan(measured=..., cuts=None): the same layout searched (or these cuts) again
REPLAN_ERRORS = (PlanError, SplitError, schedules.ScheduleError)  # a re-split that fails keeps the running one


def rebalance(planned: Planned, programs: Sequence[Program], profile: Profile, replan: Replan, *,
              gain: float = REBALANCE_GAIN, posts: Sequence[float | None] | None = None,
              replayed: bool = False) -> Rebalanced | None:
    """The same layout re-split under the measured scale, or None: nothing to re-split (one stage, unequal
    replicas, a program not measured), the same cuts, no split that fits, or new cuts less than `gain` faster
    than the running cuts, both costed under the scale by the fixed-cuts path (`Rebalanced.costed`). `posts`: each
    rank's host seconds to post a transfer (`Step.posts`) and `replayed` (`Step.replays_graphs`), so that the
    running cuts' time from their programs is simulated as the re-split's will be (`Step.predicted_step_time`)."""
    plan = planned.plan
    if plan.num_stages == 1 or any(c != 1 for c in plan.replicas):
        return None
    scale = measured_scale(plan, programs, profile)
    now = predicted_step_time(plan, planned.table, programs, profile, posts, replayed=replayed)
    if scale is None or now is None:
        log.info("rebalance: a program that runs was not measured; the planner's cuts stay")
        return None
    try:
        found = replan(measured=scale)
    except REPLAN_ERRORS as err:
        log.warning("rebalance: no re-split under the measured stage times (%s: %s); the planner's cuts stay",
                    type(err).__name__, err)
        return None
    if found.plan.cuts == plan.cuts:
        log.info("rebalance: the best split under the measured stage times (%s) keeps the running cuts %s "
                 "(predicted %.2f ms; %.2f ms from the running step's programs)", scale, list(plan.cuts),
                 found.plan.predicted_step_time * 1e3, now * 1e3)
        return None
    try:
        alike = (replan(measured=scale, cuts=plan.cuts).plan.predicted_step_time,
                 replan(measured=scale, cuts=found.plan.cuts).plan.predicted_step_time)
    except REPLAN_ERRORS as err:
        log.warning("rebalance: the running cuts %s or the new ones %s could not be costed alike under the measured "
                    "stage times (%s: %s); the planner's cuts stay", list(plan.cuts), list(found.plan.cuts),
                    type(err).__name__, err)
        return None
    if not alike[1] < alike[0] * (1 - gain):
        log.info("rebalance: the best split under the measured stage times (%s), cuts %s, costs %.2f ms against "
                 "%.2f ms for the running cuts %s, costed alike (the search's own prediction %.2f ms; %.2f ms from "
                 "the running step's programs): kept only if %g %% faster", scale, list(found.plan.cuts),
                 alike[1] * 1e3, alike[0] * 1e3, list(plan.cuts), found.plan.predicted_step_time * 1e3, now * 1e3,
                 gain * 100)
        return None
    return Rebalanced(found, plan.cuts, now, found.plan.predicted_step_time, scale, costed=alike)


def in_steps(step: Any, params: Any, example_batch: Sequence[Any], *, traced: int = 2) -> tuple[Profile, float]:
    """What `step`'s programs take inside steps: one step on the example batch to settle, then `traced` traced
    ones, every rank's spans gathered (a collective, the same result on every rank). Returns each program's
    median seconds from its inputs' arrival to its end (`profile.from_spans`) and the fastest traced step's
    seconds (its slowest rank's first-to-last instruction). With CUDA graphs the step that captures them runs
    untraced too. The step's input checks are left as before any
    step: the user's first step is still compared across ranks (`check_inputs="first"`)."""
    local = step.shard(params)
    step(local, *example_batch)
    graphs = step.executor.graphs
    if graphs is not None and graphs.state == "warm":  # CUDA graphs: the next step captures them; not one to time
        step(local, *example_batch)
    spans: list[Any] = []
    times = []
    for _ in range(traced):
        _, _, mine = step.traced(local, *example_batch)
        every = step.all_spans(mine)
        spans += every
        times.append(max(max(s.end for s in every if s.rank == r) - min(s.start for s in every if s.rank == r)
                         for r in {s.rank for s in every}))
    step.inputs.forget()
    return from_spans(spans, step.programs.all()), min(times)


def runnable(batch: Sequence[Any]) -> bool:
    """Whether steps can run on `batch` (no meta or fake tensors: an example batch may be shapes only)."""
    leaves = [x for x in batch if isinstance(x, torch.Tensor)]
    return all(x.device.type != "meta" and not isinstance(x, FakeTensor) for x in leaves)
