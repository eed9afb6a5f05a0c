"""Where `parallelize`'s time to the first step goes, phase by phase, on one rank.

Issue #15 asks for the first step within 30 s of `parallelize` on a warm compile cache, and a warm restart of
the 0.85 B Llama took 48.8 s with 12.2 s of it compiling (2 x H100, 2026-11-27): the rest was not broken down.
`parallelize` times each of its phases on this rank into a `SetupClock` (`step.setup`), logs it at INFO once
the step is built, and the benchmark records it per row. A phase run more than once (a re-split builds a
second Step, measures it, compiles its programs) adds up under its name, in the order it first ran.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import attrs


@attrs.define
class SetupClock:
    """Wall seconds per named phase, in the order each first ran (`phase` times a block, `add` records a time
    measured elsewhere, e.g. the tracing inside planning, which `take` then removes from the planning)."""

    laps: dict[str, float] = attrs.Factory(dict)
    started: float = attrs.Factory(time.perf_counter)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def add(self, name: str, seconds: float) -> None:
        self.laps[name] = self.laps.get(name, 0.0) + seconds

    def take(self, name: str, seconds: float) -> None:
        """`seconds` moved out of phase `name` (already counted under another name)."""
        if name in self.laps:
            self.laps[name] = max(0.0, self.laps[name] - seconds)

    @property
    def total(self) -> float:
        """Seconds since the clock was made (the phases and whatever ran between them)."""
        return time.perf_counter() - self.started

    def seconds(self) -> dict[str, float]:
        return dict(self.laps)

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.laps.items())
        return f"setup {self.total:.1f} s: {parts}"
