"""What posting one transfer costs a rank's host, timed before the first step.

A step whose programs launch about as fast as the device runs them (fx on CUDA, a small microbatch at depth 4)
follows its host, and the host also posts every send and receive: 0.36-0.43 ms a `comm` instruction on an H100's
host (4 x H100, zbv at p = 4, 2026-11-27: 11-16 ms of a 123 ms step; `benchmarks/diagnose_p2.py --host`), where
posting a lone 4-byte message takes 0.05-0.1 ms (2 x H100, 2026-11-27). The difference is the executor's own
work: each transfer's layout, packing its small tensors, making the receive buffers, retiring finished sends.
So the prediction charges each transfer what the executor's `comm` handler took for this rank's own transfers of
microbatch 0, posted as its program groups them, with stand-ins of their shapes (`schedules.Costs.issue_transfer`).

Every rank's program has the matching other side of each of its transfers, in the same order per channel, so the
rounds pair up: a collective, every rank of the job calls `post_seconds` at the same point. Each round's posts are
waited on (within the transport's timeout) before the next.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from .program import CommOp, Instr, Program

ROUNDS = 4  # the first is left out: a channel's first post may set things up


def first_transfers(program: Program) -> list[tuple[CommOp, ...]]:
    """The program's transfers of microbatch 0, grouped as its `comm` instructions group them, in program order."""
    groups = [tuple(c for c in ins.comm if c.mb == 0) for ins in program.instrs if ins.kind == "comm"]
    return [g for g in groups if g]


def post_seconds(executor: Any, *, rounds: int = ROUNDS) -> float | None:
    """Median host seconds per transfer of `executor.comm` over `first_transfers` (sent values stand-ins of their
    shapes, made before the clock starts); None for a program that posts nothing. The executor's step state is
    left empty, its parameters and batch as they were."""
    groups = first_transfers(executor.program)
    if not groups:
        return None
    count = sum(map(len, groups))
    kept = getattr(executor, "params", None), getattr(executor, "mbs", None)  # set by a step, if one ran
    seconds = []
    try:
        for _ in range(max(2, rounds)):
            _stand_ins(executor, groups)
            start = time.perf_counter()
            for group in groups:
                executor.comm(Instr("comm", comm=group))
            seconds.append((time.perf_counter() - start) / count)
            for ref in list(executor.pending):
                executor.buffer(ref)  # waits on the receive
            executor._drain_sends()
    finally:
        executor.params, executor.mbs = kept
        executor.bufs, executor.pending, executor.sends = {}, {}, []
    if executor.device.type == "cuda":
        torch.cuda.synchronize(executor.device)
    return statistics.median(seconds[1:])


def faster_posts(a: Sequence[float | None] | None, b: Sequence[float | None] | None) -> tuple[float | None, ...] | None:
    """Two measurements of every rank's post as one, per rank the smaller (a hiccup only ever adds time), as
    `profile.faster_of` merges the programs'; None where neither was measured."""
    if a is None or b is None:
        kept = b if a is None else a
        return None if kept is None else tuple(kept)
    return tuple(min((x for x in pair if x is not None), default=None) for pair in zip(a, b, strict=True))


def _stand_ins(executor: Any, groups: list[tuple[CommOp, ...]]) -> None:
    """Fresh step state with a stand-in for every value the transfers send, where the executor reads it from."""
    from .executor import stand_in

    params: dict[int, torch.Tensor] = {}
    batch: dict[int, torch.Tensor] = {}
    executor.bufs, executor.pending, executor.sends = {}, {}, []
    for c in (c for g in groups for c in g if c.op == "send"):
        for ref, aval in zip(c.bufs, executor.layouts(c).avals):
            value = stand_in(aval, executor.device)
            if ref[0] == "p":
                params[int(ref[1:])] = value
            elif ref[0] == "x":
                batch[int(ref[1:])] = value
            else:
                executor.bufs[ref] = value
    executor.params, executor.mbs = params, [batch]
