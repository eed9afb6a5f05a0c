"""The data-parallel gradient all-reduce in the memory model: the flat buffer each rank sums its grads in.

With dp > 1 every rank ends its step by summing its stages' grads over its replicas (`reduce_grads`): the
runtime flattens the grads of each dtype into one contiguous buffer, all-reduces it, and hands the grads
back as views of it. While it does, the rank holds its weights, their grads, the optimizer state, and a
second copy of the grads (the flat buffer) at once; every activation is freed by then. That moment is a
rank's peak whenever its grads outweigh the activations it keeps in flight (deeper data parallelism
shrinks the microbatch, so the activations fall while the weights stay). Without this term the model
under-predicted such a rank: on the CPU test model (tests/mpi/dp_memory.py) it said 0.72 of the allocator's
peak, with it 0.999; issue #15 saw measured peaks 1.22-1.30x the prediction with DP2 x PP2 on H200s.

The buffer is counted at the size of all of a rank's grads (one dtype, the usual case; with several dtypes
the runtime sums one dtype at a time and the real peak is a little lower). `engine.execution.footprint`
replays the same buffer from the emitted program.
"""
from __future__ import annotations

from typing import Sequence

import schedules

from .memory import MemoryModel, StageMemory, rank_static


def allreduce_peaks(table: schedules.Table, stages: Sequence[StageMemory], grad_bytes: Sequence[float],
                    model: MemoryModel, dp: int) -> tuple[float, ...]:
    """Each rank's bytes while it all-reduces its grads (0 when dp == 1: there is no all-reduce): its stages'
    static bytes (weights, grads, optimizer state, comm buffers) plus the flat copy of their grads, margin
    included. `grad_bytes[s]`: stage s's grad bytes (its parameters' bytes)."""
    if dp <= 1:
        return (0.0,) * table.num_ranks
    out = []
    for rank in range(table.num_ranks):
        mine = table.stages_of(rank)
        static = rank_static(table, stages, rank) - max((stages[s].workspace for s in mine), default=0.0)
        out.append((static + sum(grad_bytes[s] for s in mine)) * (1 + model.margin))
    return tuple(out)


def with_allreduce(peaks: Sequence[float], table: schedules.Table, stages: Sequence[StageMemory],
                   grad_bytes: Sequence[float], model: MemoryModel, dp: int) -> tuple[float, ...]:
    """The rank peaks `peaks` (from the schedule's simulation) raised to the all-reduce's where it is higher."""
    return tuple(max(p, a) for p, a in zip(peaks, allreduce_peaks(table, stages, grad_bytes, model, dp)))
