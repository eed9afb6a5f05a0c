"""Timelines of tables and measured runs: ASCII (golden), Perfetto JSON and the PNG picture."""

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
    assert {e["cat"] for e in spans} == {"F", "B", "W", "comm"}
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


def _ms(rank: int, label: str, kind: str, start: float, end: float) -> schedules.Bar:
    compute = kind in schedules.COMPUTE_KINDS
    stage, micro = (int(label[0]), int(label[-1])) if compute else (None, None)
    return schedules.Bar(rank, label, kind, start / 1e3, end / 1e3, stage, micro)


# a measured 1F1B step of 2 microbatches on 2 ranks, in milliseconds
MEASURED = schedules.Timeline([
    _ms(0, "0F0", "F", 0, 1), _ms(0, "0F1", "F", 1, 2), _ms(0, "comm sendA1", "comm", 2, 2.5),
    _ms(0, "0BW0", "BW", 4.5, 6.5), _ms(0, "0BW1", "BW", 7.5, 9.5),
    _ms(0, "reduce_grads", "other", 9.5, 10),
    _ms(1, "1F0", "F", 1.5, 2.5), _ms(1, "1BW0", "BW", 2.5, 4.5), _ms(1, "1F1", "F", 4.5, 5.5),
    _ms(1, "1BW1", "BW", 5.5, 7.5),
], seconds=True)


def test_ascii_to_scale_golden() -> None:
    assert schedules.render_ascii(MEASURED, width=40) == (
        "makespan 10 ms, bubble 40.0%; 40 columns of 0.25 ms\n"
        "r0 0F0-0F1-..........0BW0----....0BW1----..\n"
        "r1 ......1F0-1BW0----1F1-1BW1----.........."
    )
    assert schedules.render_ascii(schedules.one_f_one_b(2, 3), width=48) == (
        "makespan 12, bubble 25.0%; 48 columns of 0.25\n"
        "r0 0F0-0F1-........0BW0----0F2-0BW1----....0BW2----\n"
        "r1 ....1F0-1BW0----1F1-1BW1----1F2-1BW2----........"
    )
    assert schedules.render_ascii(MEASURED, width=4).splitlines()[1:] == ["r0 0.00", "r1 .11."]
    assert schedules.render_ascii(schedules.Timeline([]), width=8) == "(no compute)"
    with pytest.raises(schedules.ScheduleError, match="width >= 1"):
        schedules.render_ascii(MEASURED, width=0)


def test_timeline_of_a_simulation_has_a_bar_per_action() -> None:
    lowered = schedules.lower(schedules.one_f_one_b(2, 2))
    sim = schedules.simulate(lowered, Costs(comm_latency=0.5))
    timeline = schedules.as_timeline(sim)
    assert schedules.as_timeline(timeline) is timeline
    assert timeline.ranks == (0, 1) and not timeline.seconds
    assert [b.label for b in timeline.bars] == [str(a) for _, _, a in lowered.positions()]
    assert {b.kind for b in timeline.bars} == {"F", "BW", "comm"}
    assert (timeline.makespan, timeline.bubble_fraction) == (sim.makespan, sim.bubble_fraction)
    assert str(timeline) == f"{len(timeline.bars)} bars on 2 ranks, {timeline.summary()}"
    assert timeline.summary() == f"makespan {sim.makespan:g}, bubble {sim.bubble_fraction:.1%}"
    assert str(MEASURED) == "10 bars on 2 ranks, makespan 10 ms, bubble 40.0%"


def test_timeline_refuses_unknown_kinds_and_ranks() -> None:
    with pytest.raises(schedules.ScheduleError, match="unknown bar kind 'forward'"):
        schedules.Bar(0, "0F0", "forward", 0.0, 1.0)
    with pytest.raises(schedules.ScheduleError, match=r"bars on ranks \[2\]"):
        schedules.Timeline([schedules.Bar(2, "x", "other", 0.0, 1.0)], ranks=(0, 1))
    assert schedules.Bar(0, "add_loss", "other", 0.0, 1.0, -1, -1).stage is None


def test_perfetto_of_a_measured_run_is_in_microseconds(tmp_path: Path) -> None:
    trace = schedules.to_perfetto(MEASURED)
    tracks = [(e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"]
    assert tracks == [(0, "rank 0"), (1, "rank 1")]
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert list(spans) == [b.label for b in MEASURED.bars]
    bw = spans["1BW0"]
    assert (bw["tid"], bw["cat"], bw["args"]) == (1, "BW", {"stage": 1, "microbatch": 0})
    assert (bw["ts"], bw["dur"]) == (pytest.approx(2500), pytest.approx(2000))
    assert (spans["comm sendA1"]["cat"], spans["reduce_grads"]["args"]) == ("comm", {})
    assert trace["otherData"]["makespan"] == pytest.approx(0.01)
    in_seconds = schedules.to_perfetto(MEASURED, us_per_unit=1)["traceEvents"]
    assert next(e["ts"] for e in in_seconds if e["name"] == "1F0") == 1.5e-3
    schedules.save_perfetto(MEASURED, tmp_path / "measured.json")
    assert json.loads((tmp_path / "measured.json").read_text()) == json.loads(json.dumps(trace))


def test_png_of_a_measured_run_is_written(tmp_path: Path) -> None:
    path = tmp_path / "measured.png"
    schedules.save_png(MEASURED, path, title="measured")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
