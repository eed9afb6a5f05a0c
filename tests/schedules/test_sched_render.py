"""Renderers: the ASCII timeline (golden), Perfetto JSON and the PNG picture."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import schedules
from schedules import Costs

ONE_F_ONE_B_2x3 = (
    "   0    1    2    3    4    5    6    7    8    9    10   11\n"
    "r0 0F0  0F1  .    .    0BW0 ---- 0F2  0BW1 ---- .    0BW2 ----\n"
    "r1 .    1F0  1BW0 ---- 1F1  1BW1 ---- 1F2  1BW2 ---- .    ."
)


def test_ascii_golden() -> None:
    table = schedules.one_f_one_b(2, 3)
    assert schedules.render_ascii(table) == ONE_F_ONE_B_2x3
    assert schedules.render_ascii(schedules.simulate(table)) == ONE_F_ONE_B_2x3
    assert schedules.render_ascii(schedules.lower(table)) == ONE_F_ONE_B_2x3  # comms take no time


def test_ascii_uses_the_step_dividing_all_times() -> None:
    sim = schedules.simulate(schedules.gpipe(2, 1), Costs(comm_latency=0.5))
    assert schedules.render_ascii(sim) == (
        "   0    0.5  1    1.5  2    2.5  3    3.5  4    4.5  5    5.5  6    6.5\n"
        "r0 0F0  ---  .    .    .    .    .    .    .    .    0BW0 ---- ---- ----\n"
        "r1 .    .    .    1F0  ---  1BW0 ---- ---- ---- .    .    .    .    ."
    )


def test_ascii_falls_back_to_event_intervals() -> None:
    sim = schedules.simulate(schedules.gpipe(2, 1), Costs(comm_latency=1 / 7919))
    header = schedules.render_ascii(sim).splitlines()[0].split()
    assert header[:3] == ["0", "1", "1.00013"]


@pytest.mark.parametrize(("schedule", "args", "options"), [
    (schedules.gpipe, (3, 4), {}),
    (schedules.one_f_one_b, (3, 4), {}),
    (schedules.interleaved_1f1b, (4, 2), {"stages_per_rank": 2}),
    (schedules.zb_h1, (4, 4), {}),
    (schedules.zbv, (4, 3), {}),
])
def test_docstring_grids_are_current(schedule: object, args: tuple[int, int],
                                     options: dict[str, int]) -> None:
    grid = schedules.render_ascii(schedule(*args, **options))  # type: ignore[operator]
    assert textwrap.indent(grid, "    ") in (schedule.__doc__ or "")


def test_perfetto_has_one_event_per_action(tmp_path: Path) -> None:
    lowered = schedules.lower(schedules.zbv(4, 4))
    sim = schedules.simulate(lowered, Costs(comm_latency=0.1))
    trace = schedules.to_perfetto(sim, us_per_unit=1000)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == sum(len(row) for row in lowered.rows)
    first = next(e for e in spans if e["name"] == "0F0")
    assert (first["tid"], first["ts"], first["dur"], first["cat"]) == (0, 0, 1000, "F")
    assert {e["tid"] for e in spans} == {0, 1}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names == ["rank 0", "rank 1"]
    path = tmp_path / "trace.json"
    schedules.save_perfetto(sim, path)
    saved = json.loads(path.read_text())
    assert sum(e["ph"] == "X" for e in saved["traceEvents"]) == len(spans)
    assert saved["otherData"]["makespan"] == sim.makespan


def test_png_is_written(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    lowered = schedules.lower(schedules.interleaved_1f1b(4, 4))
    sim = schedules.simulate(lowered, Costs(comm_latency=0.2))
    schedules.save_png(sim, path, title="interleaved-1f1b")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5_000
    schedules.save_png(schedules.gpipe(1, 1), tmp_path / "tiny.png")
    assert (tmp_path / "tiny.png").read_bytes()[:4] == b"\x89PNG"
