"""Hypothesis strategies and helpers shared by the schedules tests."""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import strategies as st

import schedules
from schedules import ScheduleError, Table

ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb-h1")


@st.composite
def cases(draw: Any, names: tuple[str, ...] | None = None) -> tuple[str, int, int, dict[str, int]]:
    """(schedule name, num_stages, num_microbatches, options) valid for that schedule, with
    p in 1..8 ranks, m in 1..32 microbatches and 1..4 stages per rank where it applies."""
    name = draw(st.sampled_from(names or schedules.names()))
    p = draw(st.integers(1, 8))
    if name == "interleaved-1f1b":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, 32 // p))
        return name, p * v, m, {"stages_per_rank": v}
    if name in ("looped-bfs", "interleaved-zb"):
        v = draw(st.integers(1, 3))
        return name, p * v, draw(st.integers(1, 16)), {"stages_per_rank": v}
    if name == "dualpipev":  # DeepSeek's order pairs microbatches across the V: m >= 2p
        return name, 2 * p, draw(st.integers(2 * p, max(32, 2 * p))), {}
    m = draw(st.integers(1, 32))
    return name, 2 * p if name == "zbv" else p, m, {}


def build(name: str, num_stages: int, num_microbatches: int, options: dict[str, int]) -> Table:
    return schedules.get(name)(num_stages, num_microbatches, **options)


def swap_neighbours(table: Table, swaps: list[tuple[int, int]], check: Callable[[Table], Any]) -> Table:
    """``table`` with neighbouring actions of a row swapped wherever ``check`` still accepts the result
    (``check_structure``: the order may deadlock; ``validate``: it may not)."""
    rows = [list(row) for row in table.rows]
    for rank, step in swaps:
        row = rows[rank % len(rows)]
        if len(row) < 2:
            continue
        at = step % (len(row) - 1)
        row[at], row[at + 1] = row[at + 1], row[at]
        try:
            check(Table(table.num_stages, table.num_microbatches, table.stage_to_rank, rows))
        except ScheduleError:
            row[at], row[at + 1] = row[at + 1], row[at]
    return Table(table.num_stages, table.num_microbatches, table.stage_to_rank, rows)
