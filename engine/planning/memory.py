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
    """What one stage keeps: bytes for the whole step; per microbatch from F to its backward; and, when
    the schedule splits B and W, per microbatch from B to W instead (`after_b`: what W still reads of
    F's saved values and the stage input, plus what B hands it; None: all of F's plus `b_to_w`)."""

    static: float
    per_microbatch: float
    b_to_w: float = 0.0
    after_b: float | None = None
    workspace: float = 0.0  # temporaries of the one F, B or W running: a rank counts its largest stage's

    @property
    def between_b_and_w(self) -> float:
        return self.per_microbatch + self.b_to_w if self.after_b is None else self.after_b


@attrs.frozen
class MemoryModel:
    """Bytes of a stage from its parameters and activations; `margin` covers allocator slack."""

    optimizer_factor: float = 2.0
    margin: float = 0.10

    def stage(self, *, param_bytes: float, saved_bytes: float, recv_bytes: float = 0, send_bytes: float = 0,
              b_to_w_bytes: float = 0, workspace_bytes: float = 0, after_b_bytes: float | None = None) -> StageMemory:
        """A stage's needs: weights, grads, optimizer state, comm buffers and the temporaries of one F, B or W
        at a time; per microbatch, what it saved and received (and from B to W, `after_b_bytes`)."""
        static = param_bytes * (2 + self.optimizer_factor) + 2 * (recv_bytes + send_bytes)
        return StageMemory(static, saved_bytes + recv_bytes, b_to_w_bytes, after_b_bytes, workspace_bytes)

    def peak(self, memory: StageMemory, live: int) -> float:
        """A stage's peak bytes with `live` microbatches in flight (B/W split ignored), margin included."""
        return (memory.static + memory.workspace + live * memory.per_microbatch) * (1 + self.margin)


Live = dict[int, tuple[int, int, int]]  # stage -> (microbatches past F, of them between B and W, in a B now)


def _closing_kind(row: Sequence[schedules.Action]) -> dict[int, str]:
    """Per stage on this row, the action kind that ends a microbatch's life (W when the row splits B/W)."""
    kinds: dict[int, set[str]] = {}
    for a in row:
        kinds.setdefault(a.stage, set()).add(a.kind)
    return {s: next(k for k in ("W", "BW", "B") if k in ks) for s, ks in kinds.items() if ks & set(BACKWARD_KINDS)}


def live_trace(row: Sequence[schedules.Action]) -> list[Live]:
    """Per stage, microbatches in flight (those between B and W, and one inside a B) after each compute
    action of a row, and while each B of a split B/W runs (its hand-over to W is made then, before B's
    own frees)."""
    closing = _closing_kind(row)
    live: Live = {}
    trace = []
    for a in row:
        if not a.is_compute:
            continue
        n, bw, _ = live.get(a.stage, (0, 0, 0))
        end = closing.get(a.stage)
        if a.kind == "F":
            n += 1
        elif a.kind == end:
            n, bw = n - 1, bw - (a.kind == "W")
        elif a.kind == "B" and end == "W":
            trace.append({**live, a.stage: (n, bw, 1)})
            bw += 1
        live[a.stage] = (n, bw, 0)
        trace.append(dict(live))
    return trace


def peak_live(table: schedules.Table) -> tuple[int, ...]:
    """Largest number of microbatches in flight at each stage."""
    peaks = [0] * table.num_stages
    for row in table.rows:
        for live in live_trace(row):
            for s, (n, _, _) in live.items():
                peaks[s] = max(peaks[s], n)
    return tuple(peaks)


def _bytes(live: Live, stages: Sequence[StageMemory], only: int | None = None) -> float:
    return sum((n - bw) * stages[s].per_microbatch + bw * stages[s].between_b_and_w + b * stages[s].b_to_w
               for s, (n, bw, b) in live.items() if only is None or s == only)


def stage_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel) -> tuple[float, ...]:
    """Peak bytes of each stage on its own, margin included."""
    dynamic = [0.0] * table.num_stages
    for row in table.rows:
        for live in live_trace(row):
            for s in live:
                dynamic[s] = max(dynamic[s], _bytes(live, stages, s))
    return tuple((m.static + m.workspace + d) * (1 + model.margin) for m, d in zip(stages, dynamic))


def rank_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel) -> tuple[float, ...]:
    """Peak bytes of each rank: its stages' static bytes plus the largest in-flight sum, margin included."""
    peaks = []
    for rank, row in enumerate(table.rows):
        static = rank_static(table, stages, rank)
        dynamic = max((_bytes(live, stages) for live in live_trace(row)), default=0.0)
        peaks.append((static + dynamic) * (1 + model.margin))
    return tuple(peaks)


def rank_static(table: schedules.Table, stages: Sequence[StageMemory], rank: int) -> float:
    """Bytes a rank holds whatever the microbatches do: its stages' static bytes, and the workspace of
    its largest stage (one program runs at a time)."""
    mine = table.stages_of(rank)
    return sum(stages[s].static for s in mine) + max((stages[s].workspace for s in mine), default=0.0)


def gib(nbytes: float) -> str:
    """`31.2 GiB` for error messages."""
    return f"{nbytes / 2**30:.1f} GiB"
