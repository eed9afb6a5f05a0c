"""Chrome / Perfetto trace JSON of a schedule or a measured run: one track per rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schedules.simulate import Simulation
from schedules.table import Table
from schedules.timeline import Bar, Timeline, as_timeline

__all__ = ["save_perfetto", "to_perfetto"]


def to_perfetto(schedule: Table | Simulation | Timeline, *,
                us_per_unit: float | None = None) -> dict[str, Any]:
    """Trace events (``ph: "X"``, one per bar, ``tid`` = rank, ``cat`` = F/B/W/BW/comm/other) for
    ui.perfetto.dev; rank names come as ``ph: "M"`` metadata events.

    Trace time is in microseconds: times are multiplied by ``us_per_unit``, by default 1e6 for a
    measured run (seconds) and 1 for a simulation (pass 1e6 when its costs are in seconds).
    """
    timeline = as_timeline(schedule)
    scale = us_per_unit if us_per_unit is not None else 1e6 if timeline.seconds else 1.0
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}}
        for rank in timeline.ranks
    ]
    events += [_event(bar, scale) for bar in timeline.bars]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"makespan": timeline.makespan, "bubble_fraction": timeline.bubble_fraction,
                      "seconds": timeline.seconds},
    }


def _event(bar: Bar, scale: float) -> dict[str, Any]:
    args = {"stage": bar.stage, "microbatch": bar.microbatch}
    return {
        "name": bar.label,
        "cat": bar.kind,
        "ph": "X",
        "pid": 0,
        "tid": bar.rank,
        "ts": bar.start * scale,
        "dur": bar.length * scale,
        "args": {k: v for k, v in args.items() if v is not None},
    }


def save_perfetto(schedule: Table | Simulation | Timeline, path: str | Path, *,
                  us_per_unit: float | None = None) -> None:
    """Write ``to_perfetto`` as JSON to ``path`` (open it at ui.perfetto.dev)."""
    Path(path).write_text(json.dumps(to_perfetto(schedule, us_per_unit=us_per_unit)))
