"""schedule="auto": plan every candidate schedule with the model's own costs and keep the fastest that fits.

Each candidate is a search of its own (`search.Session`: layouts x stages x dp x microbatches, split, made exact
by stage autodiff, simulated under the memory limit), all on one Workshop, so the model is traced once and each
stage's F/B/W programs are built once whatever the schedule. The candidates are every built-in schedule; a
zero-bubble schedule's order is built for the plan's stage costs (schedules.from_costs). The chosen plan records
every candidate with its exact predicted step time (`Plan.considered`, shown by `print(plan)`).

The choice is the earliest candidate (CANDIDATES runs from the simplest schedule to the most involved) whose
predicted step is within TIE (1 %) of the fastest: a difference that small is below what the cost model
resolves (measured / predicted spreads by 2-7 % between schedules on GPUs, BENCHMARKS.md), and on CPU the pick
by the bare minimum lost to the runner-up it beat by 0.1 % (dualpipev over zbv: 1.10x measured,
benchmarks/auto_schedule.py). So auto is never predicted more than 1 % slower than the best fixed schedule,
and prefers the order with fewer moving parts where the model cannot tell them apart.

What keeps it cheap (the default since 2026-11-25; benchmarks/auto_schedule.py prints auto's planning time
against "1f1b"'s): every candidate's layouts are ranked on estimates first, with the zero-bubble orders screened
(their hand-built orders timed under the estimated costs, `Candidates.estimated`); candidates are then made
exact from the best estimate down, and one whose best estimate is PRUNE (25 %) slower than the fastest exact
prediction so far is not (its row in `considered` says so, with the estimate; an estimate may be far below
what the exact search finds under tight memory (zb-h1 on the ResNet of benchmarks/auto_schedule.py at world 2,
tight: 18.2 ms estimated, 43.5 ms exact), so it is held against exact predictions only); the order search runs once per candidate made exact, for the split it keeps
(`search._searched`); and unequal replicas per stage (`engine.planning.replicas`) are tried for the schedule
picked on equal ones alone. A schedule that would win only with unequal replicas is therefore not found: with
equal ones it must be within TIE of the best. PRUNE is wide because a screened estimate is an upper bound
(the order search took zbv at p = 4, m = 8, B = 2F from 46.5 to 35.0 time units: 25 % below its fixed order).
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Callable, Mapping

import attrs

from ..errors import PlanError, SplitError
from .artifacts import Planned

if TYPE_CHECKING:
    from .candidates import Candidate
    from .search import Session

log = logging.getLogger("engine.plan")

AUTO = "auto"
CANDIDATES = ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "interleaved-zb", "dualpipev")
TIE = 0.01  # candidates predicted within 1 % of the fastest are ties: the earliest of them is chosen
PRUNE = 0.25  # a candidate whose best estimate is 25 % slower than the best one's is not made exact
MULTI_STAGE_ONLY = ("interleaved-1f1b", "looped-bfs", "zbv", "interleaved-zb", "dualpipev")
Row = tuple[str, str, float]  # (schedule, its layout or why it does not fit, predicted step time or inf)


def _layout(stages: int, depth: int, dp: int, microbatches: int) -> str:
    return f"{stages} stages on {depth} ranks x dp {dp}, {microbatches} microbatches"


def _applicable(name: str, stages_per_rank: int | None) -> bool:
    """Whether `name` can run the user's fixed choices (stages_per_rank=1 rules out the multi-stage ones)."""
    v = stages_per_rank
    if v is not None and v > 1:
        return name in MULTI_STAGE_ONLY and (v == 2 or name not in ("zbv", "dualpipev"))
    return not (v == 1 and name in MULTI_STAGE_ONLY)


def pick(times: Mapping[str, float]) -> str:
    """The earliest schedule in `times` (in CANDIDATES order) predicted within TIE of the fastest; inf and NaN
    (does not fit) never. PlanError when none fits."""
    fitting = {name: t for name, t in times.items() if math.isfinite(t)}
    if not fitting:
        raise PlanError("no candidate schedule fits")
    fastest = min(fitting.values())
    order = sorted(fitting, key=lambda name: CANDIDATES.index(name) if name in CANDIDATES else len(CANDIDATES))
    return next(name for name in order if fitting[name] <= fastest * (1 + TIE))


def _row(name: str, cand: Candidate) -> Row:
    layout = cand.layout
    return name, _layout(layout.num_stages, layout.pipeline_depth, layout.dp, layout.microbatches), cand.step_time


def pipelined(world_size: int, dp: object) -> bool:
    """Whether a layout can have more than one rank per pipeline: without, every schedule runs the same step."""
    return world_size > 1 and not (isinstance(dp, int) and not isinstance(dp, bool) and dp == world_size)


def _none_fits(errors: list[PlanError | SplitError], names: list[str]) -> Exception:
    """Why no candidate fits: the simplest candidate's own error where every candidate refused the user's counts
    (PlanError: the fix is the same whatever the schedule), else each distinct reason once."""
    if errors and all(isinstance(err, PlanError) for err in errors):
        return errors[0]
    seen: dict[str, list[str]] = {}
    for name, err in zip(names, errors):
        seen.setdefault(str(err), []).append(name)
    return SplitError('schedule="auto": no schedule fits: ' + "; ".join(
        f"{', '.join(who)}: {why}" for why, who in list(seen.items())[:4]))


def _open(open_session: Callable[[str], Session], stages_per_rank: int | None
          ) -> dict[str, Session | PlanError | SplitError]:
    """Each applicable candidate's search (CANDIDATES' order), or the error that refused it."""
    out: dict[str, Session | PlanError | SplitError] = {}
    for name in CANDIDATES:
        if _applicable(name, stages_per_rank):
            try:
                out[name] = open_session(name)
            except (PlanError, SplitError) as err:
                out[name] = err
    return out


def _estimate(session: Session) -> float | None:
    """The fastest layout on estimates (None for the user's cuts, which are not ranked; inf where no layout fits
    the estimates: its exact search then says why)."""
    if session.cuts is not None:
        return None
    ranked, _ = session.ranked()
    return ranked[0].step_time if ranked else math.inf


def _first(estimate: float | None) -> float:
    """Sort key: candidates with an estimate by it, the others (cuts given, or one rank) after, in CANDIDATES order
    (a stable sort)."""
    return math.inf if estimate is None else estimate


def search_auto(open_session: Callable[[str], Session], *, stages_per_rank: int | None = None,
                pipeline: bool = True) -> Planned:
    """The applicable candidate schedules ranked on estimates, made exact unless PRUNE past the best so far; the one
    `pick` takes, finished (unequal replicas tried for it alone), its plan listing them all. With no `pipeline`
    (one rank, or dp over the whole world) the first candidate that fits is the step every other one would run."""
    sessions: dict[str, Session] = {}
    rows: list[Row] = []
    errors: list[PlanError | SplitError] = []
    opened = _open(open_session, stages_per_rank)
    estimates = {name: _estimate(s) for name, s in opened.items() if pipeline and not isinstance(s, Exception)}
    best = math.inf  # the fastest exact prediction so far
    for name in sorted(opened, key=lambda n: _first(estimates.get(n))):  # the most promising first
        session, estimate = opened[name], estimates.get(name)
        if estimate is not None and estimate > best * (1 + PRUNE):
            rows.append((name, f"estimated {estimate / best:.2f} x the best exact: not made exact", estimate))
            continue
        try:
            if isinstance(session, Exception):
                raise session
            rows.append(_row(name, session.exact()))
            best = min(best, rows[-1][2])
        except (PlanError, SplitError) as err:
            errors.append(err)
            rows.append((name, str(err).split(";")[0][:80], math.inf))
            log.debug("auto: %s does not fit: %s", name, err)
            continue
        sessions[name] = session
        if not pipeline:
            break
    if not sessions:
        raise _none_fits(errors, [name for name, _, t in rows if not math.isfinite(t)])
    chosen = pick({name: t for name, _, t in rows if name in sessions})
    planned = sessions[chosen].finish()
    p = planned.plan
    rows = [(name, _layout(p.num_stages, p.pipeline_depth, p.dp, p.microbatches), p.predicted_step_time)
            if name == chosen else (name, text, t) for name, text, t in rows]  # unequal replicas may have won
    rows.sort(key=lambda row: row[2])
    plan = attrs.evolve(p, considered=tuple(rows))
    log.info('schedule="auto" chose %s (%.3g ms)', plan.schedule, plan.predicted_step_time * 1e3)
    return attrs.evolve(planned, plan=plan)
