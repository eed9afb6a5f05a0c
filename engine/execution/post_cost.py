"""What posting one transfer costs a rank's host, timed before the first step.

A step whose programs launch about as fast as the device runs them (fx on CUDA, a small microbatch at depth 4)
follows its host, and the host also posts every send and receive: 0.36-0.43 ms a group on an H100's host
(4 x H100, zbv at p = 4, 2026-11-27: 11-16 ms of a 123 ms step; `benchmarks/diagnose_p2.py --host`). The
prediction charges each transfer this rank's measured post (`schedules.Costs.issue_transfer`).

`post_seconds` posts one message of every (send or receive, peer) pair this rank's program has, a few rounds,
and times the host's posting alone (each round then waited on, within the transport's timeout). Every rank's
program has the matching other side of each of its pairs, so the rounds pair up: a collective, every rank of
the job calls it at the same point.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .program import Program
from .transport import Transport

ROUNDS = 6  # the first is left out: a channel's first post may set things up


def pairs(program: Program) -> list[tuple[str, int]]:
    """Each (op, peer) the program posts, once, in a fixed order."""
    return sorted({(c.op, c.peer) for ins in program.instrs if ins.kind == "comm" for c in ins.comm})


def post_seconds(transport: Transport, program: Program, device: torch.device, *, rounds: int = ROUNDS
                 ) -> float | None:
    """Median host seconds to post one transfer (the executor's buffer for a receive made first, as it
    makes one); None for a program that posts nothing."""
    todo = pairs(program)
    if not todo:
        return None
    seconds = []
    for _ in range(max(2, rounds)):
        start = time.perf_counter()
        ops = [(op, peer, _buffer(transport, op, peer, device)) for op, peer in todo]
        handles: list[Any] = transport.post(ops, pooled=True)
        seconds.append((time.perf_counter() - start) / len(ops))
        for handle in handles:
            transport.wait(handle, "timing a post at start-up")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(seconds[1:])


def _buffer(transport: Transport, op: str, peer: int, device: torch.device) -> torch.Tensor:
    if op == "send":
        return torch.zeros(1, device=device)
    with transport.receiving(peer):  # where the executor makes a receive's buffer (a gate's or copy stream's pool)
        return torch.empty(1, device=device)
