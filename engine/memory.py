"""The memory model: bytes a stage needs per microbatch and statically, and the peak of each rank.

A stage holds its parameters with their grads and optimizer state (`param bytes x (2 + optimizer
factor)`, factor 2 for Adam), one send and one receive buffer each way, the temporaries of the one F, B or
W running, and per microbatch in flight the activations F saved for B/W plus the received input B/W read. How many microbatches are in flight is a
property of the schedule: a rank runs its actions in order, so walking its row (F opens a microbatch of
that stage, its last backward action closes it) gives the exact peak for any timing. A rank holding
several stages (interleaved, ZB-V) peaks at the largest sum over its stages, not at the sum of peaks.
"""
from __future__ import annotations

from typing import Sequence

import attrs

import schedules

BACKWARD_KINDS = ("B", "BW", "W")


@attrs.frozen
class StageMemory:
    """What one stage keeps: bytes for the whole step, per microbatch from F to its last backward,
    and per microbatch from B to W (the input grads W still reads, when the schedule splits them)."""

    static: float
    per_microbatch: float
    b_to_w: float = 0.0


@attrs.frozen
class MemoryModel:
    """Bytes of a stage from its parameters and activations; `margin` covers allocator slack."""

    optimizer_factor: float = 2.0
    margin: float = 0.10

    def stage(self, *, param_bytes: float, saved_bytes: float, recv_bytes: float = 0, send_bytes: float = 0,
              b_to_w_bytes: float = 0, workspace_bytes: float = 0) -> StageMemory:
        """A stage's needs: weights, grads, optimizer state, comm buffers and the temporaries of one F, B or W
        at a time; per microbatch, what it saved and received."""
        static = param_bytes * (2 + self.optimizer_factor) + 2 * (recv_bytes + send_bytes) + workspace_bytes
        return StageMemory(static, saved_bytes + recv_bytes, b_to_w_bytes)

    def peak(self, memory: StageMemory, live: int) -> float:
        """A stage's peak bytes with `live` microbatches in flight (B/W split ignored), margin included."""
        return (memory.static + live * memory.per_microbatch) * (1 + self.margin)


Live = dict[int, tuple[int, int]]  # stage -> (microbatches past F, microbatches between B and W)


def _closing_kind(row: Sequence[schedules.Action]) -> dict[int, str]:
    """Per stage on this row, the action kind that ends a microbatch's life (W when the row splits B/W)."""
    kinds: dict[int, set[str]] = {}
    for a in row:
        kinds.setdefault(a.stage, set()).add(a.kind)
    return {s: next(k for k in ("W", "BW", "B") if k in ks) for s, ks in kinds.items() if ks & set(BACKWARD_KINDS)}


def live_trace(row: Sequence[schedules.Action]) -> list[Live]:
    """Per stage, microbatches in flight (and those between B and W) after each compute action of a row."""
    closing = _closing_kind(row)
    live: Live = {}
    trace = []
    for a in row:
        if not a.is_compute:
            continue
        n, bw = live.get(a.stage, (0, 0))
        end = closing.get(a.stage)
        if a.kind == "F":
            n += 1
        elif a.kind == end:
            n, bw = n - 1, bw - (a.kind == "W")
        elif a.kind == "B" and end == "W":
            bw += 1
        live[a.stage] = (n, bw)
        trace.append(dict(live))
    return trace


def peak_live(table: schedules.Table) -> tuple[int, ...]:
    """Largest number of microbatches in flight at each stage."""
    peaks = [0] * table.num_stages
    for row in table.rows:
        for live in live_trace(row):
            for s, (n, _) in live.items():
                peaks[s] = max(peaks[s], n)
    return tuple(peaks)


def _bytes(live: Live, stages: Sequence[StageMemory], only: int | None = None) -> float:
    return sum(n * stages[s].per_microbatch + bw * stages[s].b_to_w
               for s, (n, bw) in live.items() if only is None or s == only)


def stage_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel) -> tuple[float, ...]:
    """Peak bytes of each stage on its own, margin included."""
    dynamic = [0.0] * table.num_stages
    for row in table.rows:
        for live in live_trace(row):
            for s in live:
                dynamic[s] = max(dynamic[s], _bytes(live, stages, s))
    return tuple((m.static + d) * (1 + model.margin) for m, d in zip(stages, dynamic))


def rank_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel) -> tuple[float, ...]:
    """Peak bytes of each rank: its stages' static bytes plus the largest in-flight sum, margin included."""
    peaks = []
    for rank, row in enumerate(table.rows):
        static = sum(stages[s].static for s in table.stages_of(rank))
        dynamic = max((_bytes(live, stages) for live in live_trace(row)), default=0.0)
        peaks.append((static + dynamic) * (1 + model.margin))
    return tuple(peaks)


def gib(nbytes: float) -> str:
    """`31.2 GiB` for error messages."""
    return f"{nbytes / 2**30:.1f} GiB"
