"""The hand-built zero-bubble orders of torch.distributed.pipelining, rebuilt natively as candidate seeds."""

from __future__ import annotations

import functools

# ``schedules.from_costs`` builds an order for the plan's times by a list-scheduling search. A search
# that merely lands near the best order can lose by a few per cent to a hand-built loop whose steady
# state happens to suit the costs (PyTorch's interleaved zero-bubble loop with B = 2F, its ZBV order
# with slow links). So the builder also times, as candidates, the orders PyTorch's own schedules
# generate for the same family and counts: the best candidate is then never slower, on the simulator,
# than PyTorch's order for the same costs and memory limit (the builder keeps only what fits).
#
# These functions are pure Python (no torch import: ``schedules`` depends on the standard library
# only); they follow, step for step, ``ScheduleInterleavedZeroBubble._calculate_single_rank_operations``
# (with ``_get_1f1b_rank_ops(enable_zero_bubble=True)``) and ``ScheduleZBVZeroBubble``'s, torch 2.13.
# PyTorch pads its rows with ``None`` bubbles; a table's order needs none (the simulator starts each
# action when its inputs are there). ``tests/engine/test_torch_orders.py`` checks that the rows equal
# PyTorch's generated orders wherever the installed torch has its visualizer.

from schedules.action import Action, B, F, W
from schedules.table import Table

__all__ = ["interleaved_zb_loop", "zbv_order"]


@functools.lru_cache(maxsize=64)  # a planner asks for each layout's order again for every split it costs
def interleaved_zb_loop(p: int, v: int, m: int) -> Table | None:
    """PyTorch's ScheduleInterleavedZeroBubble order (ZB1P with v stages per rank, stage s on rank
    s mod p): microbatches in rounds of m // max(1, m // p); None where PyTorch refuses m (m not a
    multiple of its rounds)."""
    rounds = max(1, m // p)
    if m % rounds:
        return None
    per_round = m // rounds
    rows = [_interleaved_row(r, p, v, m, per_round) for r in range(p)]
    return Table(p * v, m, tuple(s % p for s in range(p * v)), rows)


class _Row:
    """A rank's row being written: each stage's F, B and W numbered in the order they are added."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.count: dict[tuple[int, str], int] = {}

    def add(self, *steps: tuple[int, str], times: int = 1) -> None:
        """``steps`` (stage, kind) in turn, ``times`` over, each on its stage's next microbatch of that kind."""
        for _ in range(times):
            for stage, kind in steps:
                i = self.count.get((stage, kind), 0)
                self.count[(stage, kind)] = i + 1
                self.actions.append(Action(stage, kind, i))

    def done(self, stage: int, kind: str) -> int:
        return self.count.get((stage, kind), 0)


def _interleaved_row(r: int, p: int, v: int, m: int, per_round: int) -> list[Action]:
    warmup = min((v - 1) * per_round + (p - 1 - r), m * v)

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * p + r

    def backward_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * p + r

    row = _Row()
    backward_ops: list[int] = []
    weights = 0
    for op in range(m * v + warmup):  # warm-up forwards, then F + B pairs, then the cool-down's B's
        if op < m * v:
            row.add((forward_stage(op), F))
        if op >= warmup:
            row.add((backward_stage(op), B))
            backward_ops.append(op)
            if op - warmup >= r:  # rank r runs each W r backwards after its B (ZB-H1's lag)
                row.add((backward_stage(backward_ops[weights]), W))
                weights += 1
    for op in backward_ops[weights:]:
        row.add((backward_stage(op), W))
    return row.actions


@functools.lru_cache(maxsize=64)
def zbv_order(p: int, m: int) -> Table:
    """PyTorch's ScheduleZBVZeroBubble order on p ranks (rank r holds stages r and 2p-1-r): a warm-up
    of 2(p-r)-1 forwards down the V, then F, B, W of each leg in turn, the W's held back in the
    cool-down; counted as if m were at least 2p-1, the actions of the missing microbatches dropped."""
    n = max(2 * p - 1, m)
    rows = [[a for a in _zbv_row(r, p, n) if a.microbatch < m] for r in range(p)]
    return Table(2 * p, m, tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)), rows)


def _zbv_row(r: int, p: int, n: int) -> list[Action]:
    down, up = r, 2 * p - 1 - r
    row = _Row()
    row.add((down, F), times=2 * (p - r) - 1)
    row.add((up, F), (down, F), times=r)
    row.add((up, F), (up, B), (up, W), times=p - r)
    while row.done(up, F) < row.done(down, F) or row.done(down, F) < n:  # the steady state
        if row.done(down, F) < n:
            row.add((down, F))
        row.add((down, B), (down, W), (up, F), (up, B), (up, W))
    row.add((down, B), (up, B), times=r)  # the cool-down: B's first, the W's held back
    row.add((down, B), (down, W), times=p - r)
    row.add((up, W), times=row.done(up, B) - row.done(up, W))
    row.add((down, W), times=row.done(down, B) - row.done(down, W))
    return row.actions
