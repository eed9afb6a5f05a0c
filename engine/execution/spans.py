"""Execution traces: start and end of every instruction per rank (CUDA events on GPU), merged to Perfetto."""
from __future__ import annotations

import json
import time
from typing import Any, Sequence

import attrs
import torch

from .program import COMPUTE, SHORT, Instr


@attrs.frozen
class Span:
    """One instruction's run on one rank, in seconds from the step's start."""

    rank: int
    name: str
    kind: str
    stage: int
    mb: int
    start: float
    end: float


class Tracer:
    """Times instructions of one step; on GPU with events, read after the step ends (no extra syncs)."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.cuda = rank, device.type == "cuda"
        self.marks: list[tuple[Instr, Any, Any]] = []
        self.spans: list[Span] = []

    def _now(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def begin_step(self) -> None:
        self.marks = []
        self.origin = self._now()

    def around(self, ins: Instr) -> tuple[Any, Any]:
        return ins, self._now()

    def close(self, opened: tuple[Any, Any]) -> None:
        ins, start = opened
        self.marks.append((ins, start, self._now()))

    def end_step(self) -> list[Span]:
        if self.cuda:
            torch.cuda.synchronize()
            rel = lambda e: self.origin.elapsed_time(e) / 1e3  # noqa: E731
        else:
            rel = lambda t: t - self.origin  # noqa: E731
        self.spans = [Span(self.rank, _label(i), i.kind, i.stage, i.mb, rel(s), rel(e)) for i, s, e in self.marks]
        return self.spans


def _label(ins: Instr) -> str:
    if ins.kind in SHORT:
        return f"{ins.stage}{SHORT[ins.kind]}{ins.mb}"
    if ins.kind == "comm":
        return "comm " + ",".join(f"{c.op}{c.what[0].upper()}{c.mb}" for c in ins.comm)
    return ins.kind


def to_perfetto(spans: Sequence[Span]) -> dict[str, Any]:
    """Chrome/Perfetto trace JSON: one track per rank, times in microseconds."""
    events = [{"name": s.name, "cat": s.kind, "ph": "X", "pid": 0, "tid": s.rank,
               "ts": s.start * 1e6, "dur": max(0.0, s.end - s.start) * 1e6,
               "args": {"stage": s.stage, "mb": s.mb}} for s in spans]
    ranks = sorted({s.rank for s in spans})
    events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}} for r in ranks]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_perfetto(spans: Sequence[Span], path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_perfetto(spans), f)


def stage_times(spans: Sequence[Span]) -> dict[tuple[int, str], float]:
    """Median measured seconds per (stage, F/B/W/BW) over microbatches."""
    by: dict[tuple[int, str], list[float]] = {}
    for s in spans:
        if s.kind in COMPUTE:
            by.setdefault((s.stage, s.kind), []).append(s.end - s.start)
    return {k: sorted(v)[len(v) // 2] for k, v in by.items()}


def render_spans(spans: Sequence[Span], *, width: int = 96) -> str:
    """Measured timeline as text: one line per rank, each compute instruction drawn as its label
    followed by `-` over its duration, `.` where the rank's compute stream was idle."""
    comp = [s for s in spans if s.kind in COMPUTE]
    if not comp:
        return "(no compute spans)"
    end = max(s.end for s in comp)
    scale = width / end
    lines = [f"measured step: {end * 1e3:.1f} ms, {width} columns of {end / width * 1e3:.2f} ms"]
    for rank in sorted({s.rank for s in comp}):
        row = ["."] * width
        for s in sorted((s for s in comp if s.rank == rank), key=lambda s: s.start):
            a, b = int(s.start * scale), max(int(s.start * scale) + 1, int(s.end * scale))
            cells = (s.name + "-" * width)[: b - a]
            row[a:b] = list(cells)
        lines.append(f"r{rank} " + "".join(row[:width]))
    return "\n".join(lines)
