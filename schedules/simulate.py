"""simulate: exact event-driven timing, idle time and memory of a table under a cost model."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from schedules.action import BW, Action, F, W
from schedules.costs import Costs
from schedules.execute import execute as _execute
from schedules.index import TableIndex
from schedules.table import Table
from schedules.validate import check_structure

__all__ = ["Simulation", "as_simulation", "simulate"]

_FREES = (BW, W)  # a stage's microbatch stops being live when one of these ends


@attrs.frozen(eq=False)
class Simulation:
    """When every action ran, and what that cost each rank (busy = compute time only)."""

    table: Table
    costs: Costs
    start: Mapping[Action, float]
    end: Mapping[Action, float]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float
    peak_live: tuple[int, ...]
    peak_memory: tuple[float, ...]
    stage_peak_live: tuple[int, ...] = ()  # per stage: most of its microbatches live at once
    stage_peak_memory: tuple[float, ...] = ()  # per stage: most bytes its live microbatches held (no static)

    def __str__(self) -> str:
        live = ", ".join(map(str, self.peak_live))
        return (f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%}, "
                f"peak live ({live})")


def simulate(table: Table, costs: Costs | None = None) -> Simulation:
    """Run ``table`` under ``costs`` (default: F = B = W = 1, free communication).

    Unlowered tables pay the transfer time on every dependency between ranks; lowered tables
    follow the runtime: consecutive communication actions are one group posted together, each
    send and receive completing when its partner is posted (rendezvous). Costs with host times
    (``Costs.issue_*``) give each rank a host that issues its row ahead of its device (``execute``).
    Raises ScheduleError for an invalid table (see ``validate``) or a deadlock, naming the ranks
    that wait on each other.
    """
    costs = Costs() if costs is None else costs
    costs.check(table.num_stages, table.num_ranks)
    index = check_structure(table)
    duration = [costs.compute_time(a) if a.is_compute else 0.0 for a in index.actions]
    transfer = [costs.transfer_time(s) for s in range(table.num_stages)]
    if costs.hosted:
        issue = [costs.issue_time(a) for a in index.actions]
        posts = [costs.transfer_issue(s) for s in range(table.num_stages)]
        timing = _execute(index, duration, transfer, issue, posts)
    else:
        timing = _execute(index, duration, transfer)
    makespan = max([0.0, *timing.end])
    busy = tuple(sum(duration[k] for k in row) for row in index.rows)
    idle = tuple(makespan - b for b in busy)
    total = makespan * table.num_ranks
    peaks = [_peaks(index, costs, r) for r in range(table.num_ranks)]
    stage_live, stage_memory = [0] * table.num_stages, [0.0] * table.num_stages
    for peak in peaks:
        for stage, n in peak.stage_live.items():
            stage_live[stage] = n
        for stage, m in peak.stage_memory.items():
            stage_memory[stage] = m
    return Simulation(
        table=table,
        costs=costs,
        start=MappingProxyType(dict(zip(index.actions, timing.start, strict=True))),
        end=MappingProxyType(dict(zip(index.actions, timing.end, strict=True))),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=sum(idle) / total if total > 0 else 0.0,
        peak_live=tuple(p.live for p in peaks),
        peak_memory=tuple(p.memory for p in peaks),
        stage_peak_live=tuple(stage_live),
        stage_peak_memory=tuple(stage_memory),
    )


@attrs.frozen
class _Peaks:
    """One rank's peaks, and each of its stages' on their own."""

    live: int
    memory: float
    stage_live: dict[int, int]
    stage_memory: dict[int, float]


def _peaks(index: TableIndex, costs: Costs, rank: int) -> _Peaks:
    """Peak live stage-microbatches and peak memory of one rank, walking its row in order (a rank runs
    its actions in order, so this is exact for any timing); the same per stage, for its own bytes."""
    live = peak_live = 0
    memory = peak_memory = costs.static(rank)
    now_live: dict[int, int] = {}
    now_memory: dict[int, float] = {}
    top_live: dict[int, int] = {}
    top_memory: dict[int, float] = {}
    for k in index.rows[rank]:
        action = index.actions[k]
        if not action.is_compute:
            continue
        s, opens, closes = action.stage, action.kind == F, action.kind in _FREES
        at_start, at_end = costs.memory_delta(action)
        live, memory = live + opens, memory + at_start
        now_live[s], now_memory[s] = now_live.get(s, 0) + opens, now_memory.get(s, 0.0) + at_start
        peak_live, peak_memory = max(peak_live, live), max(peak_memory, memory)
        top_live[s], top_memory[s] = max(top_live.get(s, 0), now_live[s]), max(top_memory.get(s, 0.0), now_memory[s])
        live, memory = live - closes, memory + at_end
        now_live[s], now_memory[s] = now_live[s] - closes, now_memory[s] + at_end
    return _Peaks(peak_live, peak_memory, top_live, top_memory)


def as_simulation(schedule: Table | Simulation) -> Simulation:
    """``schedule`` itself when simulated already, else its run under the default costs."""
    return schedule if isinstance(schedule, Simulation) else simulate(schedule)
