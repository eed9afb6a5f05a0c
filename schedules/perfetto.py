"""Chrome / Perfetto trace JSON of a simulated schedule: one track per rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schedules.simulate import Simulation, as_simulation
from schedules.table import Table

__all__ = ["save_perfetto", "to_perfetto"]


def to_perfetto(schedule: Table | Simulation, *, us_per_unit: float = 1.0) -> dict[str, Any]:
    """Trace events (``ph: "X"``, one per action, ``tid`` = rank) for ui.perfetto.dev.

    Simulated time is multiplied by ``us_per_unit`` (trace time is in microseconds): pass 1e6
    when costs are in seconds. Rank names come as ``ph: "M"`` metadata events.
    """
    sim = as_simulation(schedule)
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        for rank in range(sim.table.num_ranks)
    ]
    for rank, _, action in sim.table.positions():
        start, end = sim.start[action], sim.end[action]
        events.append({
            "name": str(action),
            "cat": action.kind,
            "ph": "X",
            "pid": 0,
            "tid": rank,
            "ts": start * us_per_unit,
            "dur": (end - start) * us_per_unit,
            "args": {"stage": action.stage, "microbatch": action.microbatch},
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"makespan": sim.makespan, "bubble_fraction": sim.bubble_fraction},
    }


def save_perfetto(schedule: Table | Simulation, path: str | Path, *,
                  us_per_unit: float = 1.0) -> None:
    """Write ``to_perfetto`` as JSON to ``path`` (open it at ui.perfetto.dev)."""
    Path(path).write_text(json.dumps(to_perfetto(schedule, us_per_unit=us_per_unit)))
