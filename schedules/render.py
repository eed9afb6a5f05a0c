"""render_ascii: a rank x time grid of a schedule or a measured run, idle time shown as dots."""

from __future__ import annotations

import math
from bisect import bisect_left
from fractions import Fraction
from itertools import pairwise

from schedules.errors import ScheduleError
from schedules.grid import format_grid
from schedules.simulate import Simulation
from schedules.table import Table
from schedules.timeline import Bar, Timeline, as_timeline

__all__ = ["render_ascii"]

IDLE = "."
CONTINUED = "-"
_MAX_UNIFORM_COLUMNS = 4000  # beyond this, one column per interval between event times


def _time(t: float) -> str:
    return f"{t:g}"


def _columns(times: list[float]) -> list[float]:
    """Start times of the columns: a uniform step dividing every time when there is one."""
    fractions = [Fraction(t).limit_denominator(1000) for t in times]
    exact = all(math.isclose(f, t, abs_tol=1e-9) for f, t in zip(fractions, times, strict=True))
    if exact and len(times) > 1:
        denominator = math.lcm(*(f.denominator for f in fractions))
        step = Fraction(math.gcd(*(int(f * denominator) for f in fractions)), denominator)
        count = int((fractions[-1] - fractions[0]) / step) if step else 0
        if 0 < count <= _MAX_UNIFORM_COLUMNS:
            return [float(fractions[0] + k * step) for k in range(count)]
    return [t for t, after in pairwise(times) if after > t]


def render_ascii(schedule: Table | Simulation | Timeline, *, width: int | None = None) -> str:
    """One line per rank, one column per time step (the largest step dividing all start and end
    times of compute, else one per interval between them); the header gives each column's start.

    A table is first simulated with the default costs (F = B = W = 1, BW = 2). A compute bar prints
    its label in its first column and ``-`` in the others; ``.`` is idle. Communication and other
    bars take no column. With ``width``, time is drawn to scale instead (as for a measured run):
    ``width`` columns over the makespan, each bar its label then ``-``, at least one column long.
    """
    timeline = as_timeline(schedule)
    if width is not None:
        return _to_scale(timeline, width)
    rows = [timeline.row(rank, compute=True) for rank in timeline.ranks]
    times = sorted({t for row in rows for bar in row for t in (bar.start, bar.end)})
    columns = _columns(times)
    return format_grid(
        [_row_cells(row, columns) for row in rows],
        header=[_time(t) for t in columns],
        labels=[f"r{rank}" for rank in timeline.ranks],
    )


def _row_cells(row: list[Bar], columns: list[float]) -> list[str]:
    cells = [IDLE] * len(columns)
    for bar in row:
        first = bisect_left(columns, bar.start)
        last = bisect_left(columns, bar.end)
        for c in range(first, last):
            cells[c] = bar.label if c == first else CONTINUED * len(bar.label)
    return cells


def _to_scale(timeline: Timeline, width: int) -> str:
    """``width`` characters a rank over the makespan; a later bar overwrites an earlier one."""
    if width < 1:
        raise ScheduleError(f"render_ascii needs width >= 1 column, got {width}")
    end = timeline.makespan
    if end <= 0 or not any(bar.is_compute for bar in timeline.bars):
        return "(no compute)"
    scale = width / end
    labels = [f"r{rank}" for rank in timeline.ranks]
    lines = [f"{timeline.summary()}; {width} columns of {timeline.format_time(end / width)}"]
    for label, rank in zip(labels, timeline.ranks, strict=True):
        cells = [IDLE] * width
        for bar in sorted(timeline.row(rank, compute=True), key=lambda b: b.start):
            first = min(round(bar.start * scale), width - 1)
            last = max(first + 1, min(width, round(bar.end * scale)))
            cells[first:last] = (bar.label + CONTINUED * width)[: last - first]
        lines.append(f"{label.ljust(max(map(len, labels)))} {''.join(cells)}")
    return "\n".join(lines)
