"""The hand-built zero-bubble orders of torch.distributed.pipelining, rebuilt natively as candidate seeds."""

from __future__ import annotations

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

from collections.abc import Callable

from schedules.action import Action, B, F, W
from schedules.table import Table

__all__ = ["interleaved_zb_loop", "zbv_order"]


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


def _interleaved_row(r: int, p: int, v: int, m: int, per_round: int) -> list[Action]:
    warmup = min((v - 1) * per_round + (p - 1 - r), m * v)

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * p + r

    def backward_stage(op: int) -> int:
        return (v - 1 - (op - warmup) // per_round % v) * p + r

    count: dict[tuple[int, str], int] = {}
    row: list[Action] = []

    def add(stage: int, kind: str) -> None:
        i = count.get((stage, kind), 0)
        count[(stage, kind)] = i + 1
        row.append(Action(stage, kind, i))

    backward_ops: list[int] = []
    weights = 0
    for op in range(m * v + warmup):  # warm-up forwards, then F + B pairs, then the cool-down's B's
        if op < m * v:
            add(forward_stage(op), F)
        if op >= warmup:
            add(backward_stage(op), B)
            backward_ops.append(op)
            if op - warmup >= r:  # rank r runs each W r backwards after its B (ZB-H1's lag)
                add(backward_stage(backward_ops[weights]), W)
                weights += 1
    for op in backward_ops[weights:]:
        add(backward_stage(op), W)
    return row


def zbv_order(p: int, m: int) -> Table:
    """PyTorch's ScheduleZBVZeroBubble order on p ranks (rank r holds stages r and 2p-1-r): a warm-up
    of 2(p-r)-1 forwards down the V, then F, B, W of each leg in turn, the W's held back in the
    cool-down; counted as if m were at least 2p-1, the actions of the missing microbatches dropped."""
    n = max(2 * p - 1, m)
    rows = [[a for a in _zbv_row(r, p, n) if a.microbatch < m] for r in range(p)]
    return Table(2 * p, m, tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p)), rows)


def _zbv_row(r: int, p: int, n: int) -> list[Action]:
    down, up = r, 2 * p - 1 - r
    count: dict[tuple[int, str], int] = {}
    row: list[Action] = []

    def add(stage: int, kind: str) -> None:
        i = count.get((stage, kind), 0)
        count[(stage, kind)] = i + 1
        row.append(Action(stage, kind, i))

    def each(*steps: tuple[int, str]) -> Callable[[], None]:
        return lambda: [add(*step) for step in steps]  # type: ignore[func-returns-value]

    _repeat(2 * (p - r) - 1, each((down, F)))
    _repeat(r, each((up, F), (down, F)))
    _repeat(p - r, each((up, F), (up, B), (up, W)))
    while count.get((up, F), 0) < count[(down, F)] or count[(down, F)] < n:  # the steady state
        if count[(down, F)] < n:
            add(down, F)
        each((down, B), (down, W), (up, F), (up, B), (up, W))()
    w_down, w_up = count.get((down, B), 0), count.get((up, B), 0)
    _repeat(r, each((down, B), (up, B)))
    for _ in range(p - r):  # the cool-down: rank r's last B's, each W of the first leg right behind
        add(down, B)
        row.append(Action(down, W, w_down))
        w_down += 1
    row += [Action(up, W, i) for i in range(w_up, count.get((up, B), 0))]
    row += [Action(down, W, i) for i in range(w_down, count.get((down, B), 0))]
    return row


def _repeat(times: int, step: Callable[[], None]) -> None:
    for _ in range(times):
        step()
