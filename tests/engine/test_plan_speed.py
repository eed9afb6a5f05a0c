"""The planner's shortcuts at scale equal what they stand for: in-flight microbatches counted from the rows
equal the timed simulation's, and each layout's table is built once."""
from __future__ import annotations

import pytest

import schedules
from engine.planning.memory import peak_live

SHAPES = [(2, 1), (2, 4), (4, 8), (3, 7), (8, 16)]


def _tables() -> list[tuple[str, schedules.Table]]:
    out = []
    for name in schedules.names():
        for stages, microbatches in SHAPES:
            options = {"stages_per_rank": 2} if name in ("interleaved-1f1b", "looped-bfs", "interleaved-zb") else {}
            try:
                table = schedules.get(name)(stages * (2 if options or name in ("zbv", "dualpipev") else 1),
                                            microbatches, **options)
            except schedules.ScheduleError:
                continue  # a shape this schedule does not take
            out.append((f"{name} {stages}x{microbatches}", table))
            out.append((f"{name} {stages}x{microbatches} lowered", schedules.lower(table)))
    return out


TABLES = _tables()


def test_every_schedule_is_covered() -> None:
    assert len({label.split()[0] for label, _ in TABLES}) == len(schedules.names())


@pytest.mark.parametrize("label,table", TABLES, ids=[label for label, _ in TABLES])
def test_peak_live_counts_the_rows_as_the_simulator_does(label: str, table: schedules.Table) -> None:
    assert peak_live(table) == schedules.simulate(table).stage_peak_live
