"""Execution traces: start and end of every instruction per rank (CUDA events on GPU), as a schedules.Timeline."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch

import schedules
from schedules.timeline import COMM, OTHER

from .program import COMPUTE, SHORT, Instr

UNTRACED = ("free",)  # instruction kinds a Tracer does not time: every other instruction of a program has a Span
_BAR_KIND = {**SHORT, "comm": COMM}  # instruction kind -> timeline bar kind; the rest are OTHER


@attrs.frozen
class Span:
    """One instruction's run on one rank, in seconds from the step's start. A compute's `ready` is when its
    inputs were there (after waiting for the receives it reads); `issued`, on GPU, when the host had handed the
    device its last operation, on the host's clock from the step's start (the device's and the host's step
    starts are the same moment to within a launch: the device is idle then); None where not recorded."""

    rank: int
    name: str
    kind: str
    stage: int
    mb: int
    start: float
    end: float
    ready: float | None = None
    issued: float | None = None

    @property
    def lead(self) -> float | None:
        """Seconds the device still ran it after the host had issued all of it: near zero, the device waited on
        the host (a host-bound program); None where `issued` was not recorded."""
        return None if self.issued is None else self.end - self.issued

    @property
    def busy(self) -> float:
        """Seconds it ran once its inputs were there (its whole span where `ready` was not recorded)."""
        return self.end - (self.start if self.ready is None else self.ready)

    @property
    def waited(self) -> float:
        """Seconds it waited for its received inputs."""
        return 0.0 if self.ready is None else self.ready - self.start


class Tracer:
    """Times instructions of one step (all but UNTRACED kinds); on GPU with events, read after the step ends (no
    extra syncs)."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.cuda = rank, device.type == "cuda"
        self.marks: list[tuple[Instr, Any, Any, Any]] = []
        self.spans: list[Span] = []
        self._ready: Any = None

    def _now(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def begin_step(self) -> None:
        self.marks = []
        if self.cuda:
            torch.cuda.synchronize()  # an idle device: its step start and the host's are one moment (`Span.issued`)
        self.origin = self._now()
        self.host_origin = time.perf_counter()

    def around(self, ins: Instr) -> tuple[Any, Any]:
        self._ready = None
        return ins, self._now()

    def ready(self) -> None:
        """The open instruction's inputs are there: on GPU, a mark the stream reaches once the receives it
        waits on have landed (and the work before it is done: where the host had fallen behind the device,
        the host's time between the two marks counts as waited too); on CPU, after the host has waited."""
        self._ready = self._now()

    def close(self, opened: tuple[Any, Any]) -> None:
        ins, start = opened
        self.marks.append((ins, start, self._ready, self._now(), time.perf_counter() - self.host_origin))

    def end_step(self) -> list[Span]:
        if self.cuda:
            torch.cuda.synchronize()
            rel = lambda e: self.origin.elapsed_time(e) / 1e3  # noqa: E731
        else:
            rel = lambda t: t - self.origin  # noqa: E731
        self.spans = [Span(self.rank, _label(i), i.kind, i.stage, i.mb, rel(s), rel(e), None if r is None else rel(r),
                           h if self.cuda else None) for i, s, r, e, h in self.marks]
        return self.spans


def _label(ins: Instr) -> str:
    if ins.kind in SHORT:
        return f"{ins.stage}{SHORT[ins.kind]}{ins.mb}"
    if ins.kind == "comm":
        return "comm " + ",".join(f"{c.op}{c.what[0].upper()}{c.mb}" for c in ins.comm)
    return ins.kind


def stage_times(spans: Sequence[Span]) -> dict[tuple[int, str], float]:
    """Median measured seconds per (stage, F/B/W/BW) over microbatches, each from when its inputs were there
    (`Span.busy`: waiting for a receive is not the stage's time)."""
    by: dict[tuple[int, str], list[float]] = {}
    for s in spans:
        if s.kind in COMPUTE:
            by.setdefault((s.stage, s.kind), []).append(s.busy)
    return {k: statistics.median(v) for k, v in by.items()}


def timeline(spans: Sequence[Span]) -> schedules.Timeline:
    """The measured step as the value the `schedules` writers draw (times in seconds)."""
    return schedules.Timeline(
        [schedules.Bar(s.rank, s.name, _BAR_KIND.get(s.kind, OTHER), s.start, s.end, s.stage, s.mb)
         for s in spans],
        seconds=True)


def to_perfetto(spans: Sequence[Span]) -> dict[str, Any]:
    """Chrome/Perfetto trace JSON: one track per rank, times in microseconds (`schedules.to_perfetto`)."""
    return schedules.to_perfetto(timeline(spans))


def save_perfetto(spans: Sequence[Span], path: str | Path) -> None:
    """Write `to_perfetto` to `path` (open it at ui.perfetto.dev)."""
    schedules.save_perfetto(timeline(spans), path)


def render_spans(spans: Sequence[Span], *, width: int = 96) -> str:
    """Measured timeline as text, time to scale in `width` columns (`schedules.render_ascii`)."""
    return schedules.render_ascii(timeline(spans), width=width)


def traced_instrs(instrs: Sequence[Instr]) -> list[Instr]:
    """The instructions of a program that a traced step has a Span for, in order (one rank's spans, in order,
    are one per instruction of this list where no hook skipped one)."""
    return [i for i in instrs if i.kind not in UNTRACED]
