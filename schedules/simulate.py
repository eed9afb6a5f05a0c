"""simulate: exact event-driven timing, idle time and memory of a table under a cost model."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import attrs

from schedules.action import BW, Action, F, W
from schedules.costs import Costs
from schedules.execute import Timing
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

    def __str__(self) -> str:
        live = ", ".join(map(str, self.peak_live))
        return (f"makespan {self.makespan:g}, bubble {self.bubble_fraction:.1%}, "
                f"peak live ({live})")


def simulate(table: Table, costs: Costs | None = None) -> Simulation:
    """Run ``table`` under ``costs`` (default: F = B = W = 1, free communication).

    Unlowered tables pay the transfer time on every dependency between ranks; lowered tables
    follow the runtime: consecutive communication actions are one group posted together, each
    send and receive completing when its partner is posted (rendezvous). Raises ScheduleError
    for an invalid table (see ``validate``) or a deadlock, naming the ranks that wait on each other.
    """
    costs = Costs() if costs is None else costs
    costs.check(table.num_stages, table.num_ranks)
    index = check_structure(table)
    duration = [costs.compute_time(a) if a.is_compute else 0.0 for a in index.actions]
    transfer = [costs.transfer_time(s) for s in range(table.num_stages)]
    timing = _execute(index, duration, transfer)
    makespan = max([0.0, *timing.end])
    busy = tuple(sum(duration[k] for k in row) for row in index.rows)
    idle = tuple(makespan - b for b in busy)
    total = makespan * table.num_ranks
    peaks = [_peaks(index, timing, costs, r) for r in range(table.num_ranks)]
    return Simulation(
        table=table,
        costs=costs,
        start=MappingProxyType(dict(zip(index.actions, timing.start, strict=True))),
        end=MappingProxyType(dict(zip(index.actions, timing.end, strict=True))),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=sum(idle) / total if total > 0 else 0.0,
        peak_live=tuple(live for live, _ in peaks),
        peak_memory=tuple(memory for _, memory in peaks),
    )


def _peaks(index: TableIndex, timing: Timing, costs: Costs, rank: int) -> tuple[int, float]:
    """Peak live stage-microbatches and peak memory of one rank, walking its row in time order."""
    live = peak_live = 0
    memory = peak_memory = costs.static(rank)
    for k in index.rows[rank]:
        action = index.actions[k]
        if not action.is_compute:
            continue
        at_start, at_end = costs.memory_delta(action)
        live += action.kind == F
        memory += at_start
        peak_live, peak_memory = max(peak_live, live), max(peak_memory, memory)
        live -= action.kind in _FREES
        memory += at_end
    return peak_live, peak_memory


def as_simulation(schedule: Table | Simulation) -> Simulation:
    """``schedule`` itself when simulated already, else its run under the default costs."""
    return schedule if isinstance(schedule, Simulation) else simulate(schedule)
