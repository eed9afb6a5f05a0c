"""DualPipeV: two stages per rank in a V, forwards paired with backwards of other microbatches (DeepSeek, 2024)."""

from __future__ import annotations

import functools

from schedules._params import check_counts, take_options
from schedules.action import BW, Action, B, F, W
from schedules.errors import ScheduleError
from schedules.from_costs import costs_of, option_costs, order_for, parse_times
from schedules.simulate import simulate
from schedules.table import Table

__all__ = ["dualpipev", "fuse_adjacent", "overlapped_pairs"]


def dualpipev(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """DualPipeV (DeepSeek-V3's DualPipe cut to one V, as in PyTorch's ScheduleDualPipeV) with
    p = num_stages / 2 ranks, rank r holding stages r and 2p-1-r. After the warm-up every rank runs
    **pairs**: the forward of one microbatch on one leg of the V next to the fused backward (BW) of
    another on the other leg; B and W split only where a W fills the cool-down. Needs m >= 2p.

    How the overlap runs: a pair is two adjacent actions of a row (``overlapped_pairs`` lists
    them). The runtime posts every send and receive asynchronously and waits for a received buffer
    only when a compute reads it, so the forward's output travels while the backward computes and
    the backward's input grad arrives while the forward computes: a pair's communication hides
    behind its partner's compute, which is the overlap DualPipe exists for (on GPUs the transfers
    run on NCCL's stream beside the compute stream; ``benchmarks/dualpipev_trace.py`` measures it).
    Two computes are not run on two streams at once: on one GPU they would compete for the SMs.

    ``costs`` and ``max_live`` (default 2p + 1, what DeepSeek's order holds) build the order for
    other times (``schedules.from_costs``), DeepSeek's order among the candidates.

    p=2 (4 stages), m=4, F=B=W, BW=2 (``render_ascii``)::

       0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17   18   19   20   21   22   23   24
    r0 0F0  0F1  0F2  3F0  3B0  3W0  3F1  0F3  3BW1 ---- 3F2  0BW0 ---- 3BW2 ---- 3F3  .    0BW1 ---- 3BW3 ---- 0B2  0W2  0B3  0W3
    r1 .    1F0  2F0  1F1  2F1  1F2  2BW0 ---- 2F2  1BW0 ---- 1F3  2BW1 ---- 2F3  1BW1 ---- 2BW2 ---- 1BW2 ---- 2B3  1B3  2W3  1W3
    """
    check_counts("dualpipev", num_stages, num_microbatches)
    chosen = take_options("dualpipev", options, {"costs": None, "max_live": None, "search": True})
    if num_stages % 2:
        raise ScheduleError(
            f"dualpipev places 2 stages per rank in a V, so num_stages must be even (got "
            f"{num_stages}); use {num_stages - 1 or 2} or {num_stages + 1}")
    p = num_stages // 2
    if num_microbatches < num_stages:
        raise ScheduleError(
            f"dualpipev needs at least as many microbatches as stages (DeepSeek's order pairs "
            f"them across the V): got {num_microbatches} microbatches for {num_stages} stages; "
            f"use num_microbatches >= {num_stages}, or zbv")
    fixed = _deepseek(p, num_microbatches)
    built = order_for("dualpipev", fixed, chosen, default_live=(2 * p + 1,) * p)
    if built == fixed:  # equal, not identical: build_from_costs caches
        return fixed
    fused = fuse_adjacent(built)
    costs = costs_of(parse_times("dualpipev", option_costs(chosen, 2), num_stages))
    return fused if simulate(fused, costs).makespan <= simulate(built, costs).makespan else built


@functools.lru_cache(maxsize=64)  # a planner builds the order from costs for every split it tries: seed once
def _deepseek(p: int, m: int) -> Table:
    """DeepSeek's order (PyTorch's ScheduleDualPipeV), rank by rank."""
    placement = tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return Table(2 * p, m, placement, [_rank_order(r, p, m) for r in range(p)])


def _rank_order(r: int, p: int, m: int) -> list[Action]:
    """Rank ``r``'s row of DeepSeek's order, step by step as PyTorch's ScheduleDualPipeV writes it."""
    down, up = r, 2 * p - 1 - r
    row: list[Action] = []
    count: dict[tuple[int, str], int] = {}
    weights: list[Action] = []

    def add(stage: int, kind: str) -> None:
        counter = (stage, F if kind == F else B)
        i = count.get(counter, 0)
        count[counter] = i + 1
        row.append(Action(stage, kind, i))
        if kind == B:
            weights.append(Action(stage, W, i))

    def weight() -> None:
        if weights:
            row.append(weights.pop(0))

    for _ in range(2 * (p - r - 1)):
        add(down, F)
    for _ in range(r + 1):
        add(down, F), add(up, F)
    for _ in range(p - r - 1):
        add(up, B), weight(), add(up, F)
    for _ in range(m - 2 * p + r + 1):
        add(down, F), add(up, BW)  # the pairs: F on one leg, the backward on the other
        add(up, F), add(down, BW)
    for _ in range(p - r - 1):
        add(up, BW), add(up, F), add(down, BW)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        add(up, B if split else BW)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        add(down, B if split else BW)
    for _ in range(p - r - 1):
        weight(), add(down, B if split else BW)
    for _ in range(r + 1):
        weight()
    return row


def fuse_adjacent(table: Table) -> Table:
    """Each B followed at once, on its row, by its own W becomes one BW."""
    rows = []
    for row in table.rows:
        out: list[Action] = []
        for a in row:
            last = out[-1] if out else None
            if (a.kind == W and last is not None and last.kind == B
                    and (last.stage, last.microbatch) == (a.stage, a.microbatch)):
                out[-1] = Action(a.stage, BW, a.microbatch)
            else:
                out.append(a)
        rows.append(out)
    return Table(table.num_stages, table.num_microbatches, table.stage_to_rank, rows)


def overlapped_pairs(table: Table) -> list[tuple[int, int]]:
    """(rank, step) of the first action of each pair: a forward next to a backward (B or BW) of
    another microbatch on the rank's other stage, in either order."""
    found = []
    for rank, row in enumerate(table.rows):
        compute = [(step, a) for step, a in enumerate(row) if a.is_compute]
        for (step, a), (_, b) in zip(compute, compute[1:]):
            kinds = {a.kind, b.kind}
            if F in kinds and kinds & {B, BW} and a.stage != b.stage and a.microbatch != b.microbatch:
                found.append((rank, step))
    return found
