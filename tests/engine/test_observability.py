"""Observability: log levels from ENGINE_LOG_LEVEL*, progress bars, the predicted-vs-measured report and timelines."""
from __future__ import annotations

import io
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import logs, progress, report
from engine.execution.inprocess import build_steps, run_steps
from engine.execution.profile import from_spans
from engine.execution.program import COMPUTE
from engine.planning.plan import Plan
from engine.planning.search import plan
from engine.execution.spans import Span, Tracer, render_spans, save_perfetto, stage_times, timeline, to_perfetto
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

ROOT = Path(__file__).resolve().parents[2]
EMIT = """
import logging, engine.logs
for name in ("engine.split", "engine.runtime", "engine.plan", "engine.launch"):
    log = logging.getLogger(name)
    log.debug("%s debug", name); log.info("%s info", name); log.warning("%s warning", name)
"""


def _run(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_")}
    out = subprocess.run([sys.executable, "-c", EMIT], env={**clean, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stderr


def test_log_level_env_vars_take_effect_per_module() -> None:
    err = _run({"ENGINE_LOG_LEVEL": "WARNING", "ENGINE_LOG_LEVEL_SPLIT": "DEBUG", "ENGINE_LOG_LEVEL_RUNTIME": "info",
                "RANK": "3"})
    lines = [ln for ln in err.splitlines() if "engine." in ln]
    shown = {ln.split("] ")[-1] for ln in lines}
    assert shown == {"engine.split debug", "engine.split info", "engine.split warning", "engine.runtime info",
                     "engine.runtime warning", "engine.plan warning", "engine.launch warning"}, err
    assert all("rank 3 engine." in ln for ln in lines), lines
    assert "engine.plan info" in _run({"ENGINE_LOG_LEVEL": "INFO"}).replace("] ", "\n")
    assert "engine.plan info" not in _run({})  # unset: Python's default (warnings only)


def test_configure_reads_levels_and_warns_on_bad_values() -> None:
    root = logging.getLogger("engine")
    try:
        assert logs.configure({"ENGINE_LOG_LEVEL_PLAN": "10"}) == {"engine.plan": 10}
        assert logging.getLogger("engine.plan").getEffectiveLevel() == logging.DEBUG
        assert logging.getLogger("engine.runtime").getEffectiveLevel() == logging.WARNING
        with pytest.warns(UserWarning, match="ENGINE_LOG_LEVEL_SPLIT='loud' is not a log level"):
            assert logs.configure({"ENGINE_LOG_LEVEL_SPLIT": "loud"}) == {}
        with pytest.warns(UserWarning, match="no logger engine.splitter"):
            logs.configure({"ENGINE_LOG_LEVEL_SPLITTER": "DEBUG"})
    finally:
        logs.configure({})
        for name in ("engine", *(f"engine.{m}" for m in logs.MODULES)):
            logging.getLogger(name).setLevel(logging.NOTSET)
    assert root.propagate and not any(isinstance(h, logs._EngineHandler) for h in root.handlers)


def test_line_bar_waits_two_seconds_then_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    quick = progress.LineBar(3, "planning", stream=out)
    for _ in range(3):
        quick.update()
    quick.close()
    assert out.getvalue() == ""  # under two seconds: nothing
    slow = progress.LineBar(3, "calibrating", delay=0.0, stream=out)
    slow.update()
    slow.update()  # within 10 s of the last line: not drawn on a file
    slow.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("calibrating: 1/3, ") and lines[1].startswith("calibrating: 2/3, ")
    monkeypatch.setenv("ENGINE_PROGRESS", "0")
    assert isinstance(progress.bar(3, "x"), progress._Null)
    assert progress.enabled({"RANK": "0"}) and not progress.enabled({"OMPI_COMM_WORLD_RANK": "2"})
    assert progress.enabled({"RANK": "2", "ENGINE_PROGRESS": "1"})
    assert list(progress.track(range(4), "x")) == [0, 1, 2, 3]


TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, head_dim=8)


@pytest.fixture(scope="module")
def traced() -> tuple:
    """One in-process interleaved-1F1B step, 4 stages on 2 ranks, with every instruction timed; rank 0 sleeps
    LATE seconds before its first compute, so rank 1's first compute waits at least that long for its input."""
    params, batch = init_params(TINY, torch.float32), example_batch(TINY, 8)
    fn = make_loss_fn(TINY)
    p = plan(fn, params, *batch, world_size=2, stages=4, schedule="interleaved-1f1b", microbatches=4, device="cpu")
    steps = build_steps(fn, params, batch, p)
    run_steps(steps, params, batch)  # warm-up: compile every part
    for s in steps:
        s.executor.tracer = Tracer(s.world.rank, s.world.device)
    slept: list[int] = []

    def late(executor, ins):  # type: ignore[no-untyped-def]
        if ins.kind in COMPUTE and not slept:
            slept.append(ins.mb)
            time.sleep(LATE)

    steps[0].executor.hook = late
    try:
        run_steps(steps, params, batch)
    finally:
        steps[0].executor.hook = None
    spans = [sp for s in steps for sp in s.executor.tracer.spans]
    return steps, spans


LATE = 0.2  # seconds


def test_report_compares_every_stage_and_rank(traced: tuple) -> None:
    steps, spans = traced
    p: Plan = steps[0].plan
    text = report.compare(steps[0], spans, memory={0: 1e9})
    lines = text.splitlines()
    header = lines[1].split()
    assert header[:3] == ["stage", "rank", "recompute"] and "F ratio" in lines[1] and "W meas ms" in lines[1]
    rows = [ln.split() for ln in lines[2:2 + p.num_stages]]
    assert [int(r[0]) for r in rows] == list(range(p.num_stages))
    for r in rows:
        st = p.stages[int(r[0])]
        assert int(r[1]) == st.rank
        f_pred, f_meas, f_ratio = float(r[3]), float(r[4]), float(r[5])
        assert f_pred == pytest.approx(st.forward_time * 1e3, rel=1e-3) and f_meas > 0
        assert f_ratio == pytest.approx(f_meas / f_pred, rel=0.02, abs=0.01)
    ranks = [ln.split() for ln in lines[3 + p.num_stages:]]
    assert [r[0] for r in ranks[1:]] == ["0", "1"]
    assert ranks[0][:10] == ["rank", "step", "pred", "ms", "step", "meas", "ms", "step", "ratio", "waited"]
    assert ranks[1][6] == "1" and ranks[2][6] == "-" and ranks[2][7] == "-"  # memory measured on rank 0 only
    assert float(ranks[1][5]) == pytest.approx(steps[0].memory()[0].peak / 1e9, rel=0.01)
    assert float(ranks[1][7]) == pytest.approx(1e9 / steps[0].memory()[0].peak, rel=0.01)
    for r in (0, 1):  # what each rank waited for its receives, from its spans
        waited = sum(sp.waited for sp in spans if sp.rank == r and sp.kind in COMPUTE)
        assert float(ranks[1 + r][4]) == pytest.approx(waited * 1e3, rel=1e-3, abs=1e-4)
    assert float(ranks[1][2]) > 0 and float(ranks[1][1]) == pytest.approx(p.predicted_step_time * 1e3, rel=1e-3)


def test_gather_collects_every_rank(traced: tuple) -> None:
    steps, spans = traced
    mine = [[sp for sp in spans if sp.rank == s.world.rank] for s in steps]
    out: list = [None] * len(steps)
    hub = steps[0].transport.hub
    with hub.cv:
        hub.alive, hub.failure = set(range(len(steps))), None
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, report.gather(steps[r], mine[r])))
               for r in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(o == (spans, {}) for o in out)  # rank order; no GPU memory on CPU


def test_timeline_png_and_perfetto_are_written(traced: tuple, tmp_path: Path) -> None:
    _, spans = traced
    png = tmp_path / "timeline.png"
    report.save_timeline_png(spans, png, title="tiny GPT, 2 ranks")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    trace = tmp_path / "trace.json"
    save_perfetto(spans, str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert sum(e["ph"] == "X" and e["cat"] == "F" for e in events) == 4 * 4  # 4 stages x 4 microbatches
    assert {e["cat"] for e in events if e["ph"] == "X"} <= {"F", "B", "W", "BW", "comm", "other"}
    text = render_spans(spans, width=60).splitlines()
    assert len(text) == 3 and text[0].startswith("makespan ") and all(len(t) == 63 for t in text[1:])


# one measured 1F1B step of 2 microbatches on 2 ranks, as the Tracer records it (seconds)
SPANS = [
    Span(0, "0F0", "forward", 0, 0, 0.0, 1e-3), Span(0, "0F1", "forward", 0, 1, 1e-3, 2e-3),
    Span(0, "comm sendA1", "comm", -1, -1, 2e-3, 2.5e-3),
    Span(0, "0BW0", "backward", 0, 0, 4.5e-3, 6.5e-3), Span(0, "0BW1", "backward", 0, 1, 7.5e-3, 9.5e-3),
    Span(0, "reduce_grads", "reduce_grads", -1, -1, 9.5e-3, 10e-3),
    Span(1, "1F0", "forward", 1, 0, 1.5e-3, 2.5e-3), Span(1, "1B0", "backward_input", 1, 0, 2.5e-3, 3.5e-3),
    Span(1, "1W0", "backward_weight", 1, 0, 3.5e-3, 4.5e-3), Span(1, "1F1", "forward", 1, 1, 4.5e-3, 5.5e-3),
    Span(1, "1BW1", "backward", 1, 1, 5.5e-3, 7.5e-3),
]


def test_spans_become_a_schedules_timeline() -> None:
    tl = timeline(SPANS)
    assert tl.seconds and tl.ranks == (0, 1)
    assert [b.kind for b in tl.bars] == ["F", "F", "comm", "BW", "BW", "other", "F", "B", "W", "F", "BW"]
    assert [(b.label, b.stage, b.microbatch) for b in tl.bars[2:4]] == [("comm sendA1", None, None), ("0BW0", 0, 0)]
    assert str(tl) == "11 bars on 2 ranks, makespan 10 ms, bubble 40.0%"


def test_render_spans_golden() -> None:
    assert render_spans(SPANS, width=40) == (
        "makespan 10 ms, bubble 40.0%; 40 columns of 0.25 ms\n"
        "r0 0F0-0F1-..........0BW0----....0BW1----..\n"
        "r1 ......1F0-1B0-1W0-1F1-1BW1----.........."
    )


def test_perfetto_of_spans_has_a_track_per_rank_in_microseconds() -> None:
    trace = to_perfetto(SPANS)
    tracks = [(e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["ph"] == "M"]
    assert tracks == [(0, "rank 0"), (1, "rank 1")]
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == [s.name for s in SPANS]
    w = events[8]
    assert (w["name"], w["cat"], w["tid"], w["args"]) == ("1W0", "W", 1, {"stage": 1, "microbatch": 0})
    assert (w["ts"], w["dur"]) == (pytest.approx(3500), pytest.approx(1000))
    assert [e["cat"] for e in events[2::3]] == ["comm", "other", "W"]


def test_engine_draws_nothing_itself() -> None:
    """The writers live in `schedules`; engine only turns its spans into a `schedules.Timeline`."""
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        assert "matplotlib" not in text and "traceEvents" not in text and "format_grid" not in text, path


def test_compute_spans_say_when_their_inputs_were_there(traced: tuple) -> None:
    _, spans = traced
    for sp in spans:
        if sp.kind in COMPUTE:
            assert sp.ready is not None and sp.start <= sp.ready <= sp.end
            assert sp.busy == pytest.approx(sp.end - sp.ready) and sp.waited == pytest.approx(sp.ready - sp.start)
        else:
            assert sp.ready is None and sp.busy == pytest.approx(sp.end - sp.start) and sp.waited == 0.0
    # rank 1's first compute (stage 1's F of microbatch 0) waits for stage 0's output, which rank 0 made after a
    # LATE-second sleep; the wait is its `waited`, not its busy time
    first = min((sp for sp in spans if sp.rank == 1 and sp.kind in COMPUTE), key=lambda sp: sp.start)
    assert (first.stage, first.kind, first.mb) == (1, "forward", 0)
    assert first.waited >= 0.5 * LATE and first.busy < first.waited


def test_stage_times_leave_out_the_wait_for_inputs() -> None:
    spans = [Span(1, "1F0", "forward", 1, 0, 0.0, 5e-3, ready=4e-3), Span(1, "1F1", "forward", 1, 1, 5e-3, 6e-3, 5e-3),
             Span(1, "1F2", "forward", 1, 2, 6e-3, 8e-3, 6.5e-3), Span(1, "1W0", "backward_weight", 1, 0, 8e-3, 9e-3)]
    assert stage_times(spans) == {(1, "forward"): pytest.approx(1e-3), (1, "backward_weight"): pytest.approx(1e-3)}
    tl = timeline(spans)  # the drawn bar still covers the wait
    assert (tl.bars[0].start, tl.bars[0].end) == (0.0, 5e-3)


def test_from_spans_gives_each_program_its_median_in_step_seconds(traced: tuple) -> None:
    steps, spans = traced
    programs = steps[0].programs.all()
    got = from_spans(spans, programs)
    keys = {(i.stage, i.kind, i.accumulated()) for p in programs for i in p.instrs if i.kind in COMPUTE}
    assert {c.key for c in got.programs} == keys and all(c.peak_bytes is None for c in got.programs)
    for c in got.programs:
        runs = sorted(sp.busy for sp in spans for p in programs for i in p.instrs
                      if p.rank == sp.rank and (i.stage, i.kind, i.mb) == (sp.stage, sp.kind, sp.mb)
                      and (i.stage, i.kind, i.accumulated()) == c.key)
        assert c.seconds == pytest.approx(statistics.median(runs))


def test_lead_is_what_the_device_ran_after_the_host_issued_it() -> None:
    a = Span(0, "F0", "forward", 0, 0, 0.010, 0.050, 0.012, issued=0.020)
    b = Span(0, "F1", "forward", 0, 1, 0.050, 0.0505, 0.050, issued=0.0504)
    assert a.lead == pytest.approx(0.030) and b.lead == pytest.approx(0.0001)
    assert Span(0, "F0", "forward", 0, 0, 0.0, 1.0).lead is None


def test_against_programs_sets_the_step_beside_its_programs(traced: tuple) -> None:
    steps, spans = traced
    step = steps[0]
    assert report.against_programs(step, spans) is None  # before profile_programs
    programs = step.programs.all()
    step.profile = from_spans(spans, programs)  # the programs "timed at start-up" as this step ran them
    try:
        text = report.against_programs(step, spans)
    finally:
        step.profile = None
    lines = text.splitlines()
    assert lines[1].split() == ["rank", "start-up", "ms", "in", "step", "ms", "ratio", "waited", "ms", "step", "ms",
                                "host", "lead", "ms", "min", "/", "median"]
    for r, line in zip((0, 1), lines[2:4]):
        cells = line.split()
        mine = [sp for sp in spans if sp.rank == r and sp.kind in COMPUTE]
        medians = from_spans(spans, programs)
        expected = sum(medians.of((i.stage, i.kind, i.accumulated())).seconds
                       for i in programs[r].instrs if i.kind in COMPUTE)
        assert int(cells[0]) == r
        assert float(cells[1]) == pytest.approx(expected * 1e3, rel=1e-3)
        assert float(cells[2]) == pytest.approx(sum(sp.busy for sp in mine) * 1e3, rel=1e-3)
        assert float(cells[4]) == pytest.approx(sum(sp.waited for sp in mine) * 1e3, rel=1e-3, abs=1e-4)
        assert float(cells[5]) == pytest.approx(report.step_time(spans, r) * 1e3, rel=1e-3)
        assert cells[6] == "-"  # on CPU the host is the device: no lead recorded
    sims = [float(x) for x in re.findall(r"([0-9.]+) ms", lines[4])]
    assert lines[4].startswith("simulated: from the start-up programs") and sims[0] == sims[1] > 0
    step.profile = from_spans(spans, programs)
    try:
        beside = report.beside_receives(step, spans).splitlines()
    finally:
        step.profile = None
    for r, line in zip((0, 1), beside[2:4]):  # a real step's spans are one per instruction: every compute counted
        cells = line.split()
        computes = sum(1 for i in programs[r].instrs if i.kind in COMPUTE)
        assert int(cells[0]) == r and int(cells[1]) + int(cells[3]) == computes


def test_beside_receives_splits_computes_by_a_receive_still_waiting() -> None:
    """Rank 0 posts two receives in one comm instruction at 0: stage 1's activation, there for its forward at
    25 ms, and stage 0's grad, there for its backward at 40 ms. The two stage-0 forwards (10 ms each, 8 ms at
    start-up: 1.25 x) and stage 1's forward (25-35 ms, as at start-up: 1.0 x) ran beside a waiting receive, the
    backward (40-50 ms, 5 ms at start-up: 2.0 x) beside none. Rank 1's spans are not one per instruction."""
    from engine.execution.profile import Profile, ProgramCost
    from engine.execution.program import CommOp, Instr

    instrs = [Instr("comm", comm=(CommOp("recv", "act", 1, 0, 1, ("a0",)), CommOp("recv", "grad", 0, 1, 1, ("g1",)))),
              Instr("forward", 0, 0, reads=("x0",), writes=("h0",)),
              Instr("forward", 0, 1, reads=("x1",), writes=("h1",)),
              Instr("forward", 1, 0, reads=("a0",), writes=("y0",)),
              Instr("backward_input", 0, 1, reads=("g1", "h1"), writes=("d1",))]
    spans = [Span(0, "comm recvA0,recvG1", "comm", -1, -1, 0.0, 0.001),
             Span(0, "0F0", "forward", 0, 0, 0.001, 0.011, 0.001),
             Span(0, "0F1", "forward", 0, 1, 0.011, 0.021, 0.011),
             Span(0, "1F0", "forward", 1, 0, 0.021, 0.035, 0.025),
             Span(0, "0B1", "backward_input", 0, 1, 0.035, 0.050, 0.040),
             Span(1, "2F0", "forward", 2, 0, 0.0, 0.01, 0.0)]

    class Programs:
        def all(self) -> list:  # type: ignore[type-arg]
            return [type("P", (), {"instrs": instrs})(), type("P", (), {"instrs": instrs})()]

    class Step:
        programs = Programs()
        profile = Profile([ProgramCost(0, "forward", (), 0.008, None), ProgramCost(1, "forward", (), 0.010, None),
                           ProgramCost(0, "backward_input", (), 0.005, None)])

    assert report.beside_receives(type("S", (), {"profile": None})(), spans) is None
    lines = report.beside_receives(Step(), spans).splitlines()
    assert lines[2].split() == ["0", "3", "1.250", "1", "2.000"]
    assert lines[3].split() == ["1", "-", "-", "-", "-"]
