"""schedule="auto": plan every candidate schedule with the model's own costs and keep the fastest that fits.

Each candidate goes through the same search as a named schedule (layouts x stages x dp x microbatches, split,
made exact by stage autodiff, simulated under the memory limit), sharing one Workshop, so the model is traced
once and each stage's F/B/W programs are built once whatever the schedule. The candidates are every built-in
schedule; a zero-bubble schedule's order is built for the plan's stage costs (schedules.from_costs). The
chosen plan records every candidate with its predicted step time (`Plan.considered`, shown by `print(plan)`).
Since the choice is the minimum of the candidates' predicted step times, it is never predicted slower than
the best fixed schedule; whether predictions rank the schedules as GPUs do is what benchmarks/gpu_pipeline.py
(`--schedules auto,...`) measures, and why "auto" is not yet the default.
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
    best = min(found, key=lambda p: p.plan.predicted_step_time)  # ties: the earlier (simpler) candidate
    rows.sort(key=lambda row: row[2])
    plan = attrs.evolve(best.plan, considered=tuple(rows))
    log.info('schedule="auto" chose %s (%.3g ms)', plan.schedule, plan.predicted_step_time * 1e3)
    return attrs.evolve(best, plan=plan)
