"""The memory model: bytes a stage needs per microbatch and statically, and the peak of each rank and stage.

A stage holds its parameters with their grads and optimizer state (`param bytes x (2 + optimizer
factor)`, factor 2 for Adam), one send and one receive buffer each way, the temporaries of the one F, B or
W running, and per microbatch in flight the activations F saved for B/W plus the received input B/W
read. How many microbatches are in flight is a property of the schedule: `schedules.simulate` walks
each rank's row (a rank runs its actions in order, so the peak is exact for any timing); this module
gives it the bytes and reads the peaks back. A rank holding several stages (interleaved, ZB-V) peaks at
the largest sum over its stages, not at the sum of peaks. (The bytes a step really holds are replayed
from the emitted programs by `engine.execution.footprint`.)
"""
from __future__ import annotations

from typing import Sequence

import attrs

import schedules


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


def peak_live(table: schedules.Table) -> tuple[int, ...]:
    """Largest number of microbatches in flight at each stage (`schedules.simulate` walks the rows)."""
    return schedules.simulate(table).stage_peak_live


def stage_costs_of(table: schedules.Table, stages: Sequence[StageMemory]) -> schedules.Costs:
    """The simulator's memory view of `stages` on `table` (times left at their defaults)."""
    return schedules.Costs(
        memory_per_microbatch=tuple(m.per_microbatch for m in stages), memory_b_to_w=tuple(m.b_to_w for m in stages),
        static_memory=tuple(rank_static(table, stages, r) for r in range(table.num_ranks)),
        memory_after_b=tuple(m.between_b_and_w for m in stages))


def stage_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel,
                sim: schedules.Simulation | None = None) -> tuple[float, ...]:
    """Peak bytes of each stage on its own, margin included (`sim`: the table simulated with these
    stages' memory, if the caller has it)."""
    sim = sim or schedules.simulate(table, stage_costs_of(table, stages))
    return tuple((m.static + m.workspace + d) * (1 + model.margin) for m, d in zip(stages, sim.stage_peak_memory))


def rank_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel,
               sim: schedules.Simulation | None = None) -> tuple[float, ...]:
    """Peak bytes of each rank: its stages' static bytes plus the largest in-flight sum, margin included
    (the walk over each rank's row is `schedules.simulate`'s)."""
    sim = sim or schedules.simulate(table, stage_costs_of(table, stages))
    return tuple(peak * (1 + model.margin) for peak in sim.peak_memory)


def rank_static(table: schedules.Table, stages: Sequence[StageMemory], rank: int) -> float:
    """Bytes a rank holds whatever the microbatches do: its stages' static bytes, and the workspace of
    its largest stage (one program runs at a time)."""
    mine = table.stages_of(rank)
    return sum(stages[s].static for s in mine) + max((stages[s].workspace for s in mine), default=0.0)

