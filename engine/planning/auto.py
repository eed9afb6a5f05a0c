"""schedule="auto": plan every candidate schedule with the model's own costs and keep the fastest that fits.

Each candidate goes through the same search as a named schedule (layouts x stages x dp x microbatches, split,
made exact by stage autodiff, simulated under the memory limit), sharing one Workshop, so the model is traced
once and each stage's F/B/W programs are built once whatever the schedule. The candidates are every built-in
schedule; a zero-bubble schedule's order is built for the plan's stage costs (schedules.from_costs). The
chosen plan records every candidate with its predicted step time (`Plan.considered`, shown by `print(plan)`).
The choice is the earliest candidate (CANDIDATES runs from the simplest schedule to the most involved) whose
predicted step is within TIE (1 %) of the fastest: a difference that small is below what the cost model
resolves (measured / predicted spreads by 2-7 % between schedules on GPUs, BENCHMARKS.md), and on CPU the pick
by the bare minimum lost to the runner-up it beat by 0.1 % (dualpipev over zbv: 1.10x measured,
benchmarks/auto_schedule.py). So auto is never predicted more than 1 % slower than the best fixed schedule,
and prefers the order with fewer moving parts where the model cannot tell them apart.

Why "auto" is not the default (benchmarks/NOTES.md, "schedule=auto as the default?"): it plans every candidate,
1.8-9.4x the planning time of the default "1f1b" on the small models of benchmarks/auto_schedule.py, above the
2x this project allows; and CPU measurements agree with its picks only within their own noise (two runs of one
plan differ by up to 1.7x on a shared machine): the GPU rows of `h200_session.sh schedlib` are the test.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import attrs

from ..errors import PlanError, SplitError
from .artifacts import Planned, Workshop
from .plan import Plan

log = logging.getLogger("engine.plan")

AUTO = "auto"
CANDIDATES = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "interleaved-zb", "dualpipev")
TIE = 0.01  # candidates predicted within 1 % of the fastest are ties: the earliest of them is chosen
MULTI_STAGE_ONLY = ("interleaved-1f1b", "looped-bfs", "zbv", "interleaved-zb", "dualpipev")


def _layout(plan: Plan) -> str:
    return (f"{plan.num_stages} stages on {plan.pipeline_depth} ranks x dp {plan.dp}, "
            f"{plan.microbatches} microbatches")


def _applicable(name: str, options: dict[str, Any]) -> bool:
    """Whether `name` can run the user's fixed choices (stages_per_rank=1 rules out the multi-stage ones)."""
    v = options.get("stages_per_rank")
    if v is not None and v > 1:
        return name in MULTI_STAGE_ONLY and (v == 2 or name not in ("zbv", "dualpipev"))
    return not (v == 1 and name in MULTI_STAGE_ONLY)


def search_auto(search: Callable[..., Planned], fn: Any, params: Any, *example_batch: Any, workshop: Workshop,
                **options: Any) -> Planned:
    """`search` for each candidate schedule; the fastest predicted Planned, its plan listing them all."""
    found: list[Planned] = []
    rows: list[tuple[str, str, float]] = []
    reasons: list[str] = []
    for name in CANDIDATES:
        if not _applicable(name, options):
            continue
        try:
            planned = search(fn, params, *example_batch, schedule=name, workshop=workshop, **options)
        except (PlanError, SplitError) as err:
            reasons.append(f"{name}: {err}")
            rows.append((name, str(err).split(";")[0][:80], float("inf")))
            log.debug("auto: %s does not fit: %s", name, err)
            continue
        found.append(planned)
        rows.append((name, _layout(planned.plan), planned.plan.predicted_step_time))
    if not found:
        raise SplitError('schedule="auto": no schedule fits: ' + "; ".join(reasons[:4]))
    fastest = min(p.plan.predicted_step_time for p in found)
    best = next(p for p in found if p.plan.predicted_step_time <= fastest * (1 + TIE))  # the earliest near-tie
    rows.sort(key=lambda row: row[2])
    plan = attrs.evolve(best.plan, considered=tuple(rows))
    log.info('schedule="auto" chose %s (%.3g ms)', plan.schedule, plan.predicted_step_time * 1e3)
    return attrs.evolve(best, plan=plan)
