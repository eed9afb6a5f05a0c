"""render_ascii: a rank x time grid of a simulated schedule, idle time shown as dots."""

from __future__ import annotations

import math
from bisect import bisect_left
from fractions import Fraction
from itertools import pairwise

from schedules.action import Action
from schedules.grid import format_grid
from schedules.simulate import Simulation, as_simulation
from schedules.table import Table

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


def render_ascii(schedule: Table | Simulation) -> str:
    """One line per rank, one column per time step (the largest step dividing all start and end
    times of compute, else one per interval between them); the header gives each column's start.

    A table is first simulated with the default costs (F = B = W = 1, BW = 2). An action prints
    its name in its first column and ``-`` in the others; ``.`` is idle. Communication actions
    take no column.
    """
    sim = as_simulation(schedule)
    computes = [[a for a in row if a.is_compute] for row in sim.table.rows]
    times = sorted({t for row in computes for a in row for t in (sim.start[a], sim.end[a])})
    columns = _columns(times)
    cells = [_row_cells(sim, row, columns) for row in computes]
    return format_grid(
        cells,
        header=[_time(t) for t in columns],
        labels=[f"r{rank}" for rank in range(sim.table.num_ranks)],
    )


def _row_cells(sim: Simulation, row: list[Action], columns: list[float]) -> list[str]:
    cells = [IDLE] * len(columns)
    for action in row:
        first = bisect_left(columns, sim.start[action])
        last = bisect_left(columns, sim.end[action])
        for c in range(first, last):
            cells[c] = str(action) if c == first else CONTINUED * len(str(action))
    return cells
