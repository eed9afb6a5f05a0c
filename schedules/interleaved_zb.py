"""Interleaved zero bubble: v stages per rank in a loop, split backward, ordered from costs (Qi et al., 2024)."""

from __future__ import annotations

from schedules._params import check_counts, positive_int, take_options
from schedules.errors import ScheduleError
from schedules.from_costs import build_from_costs, order_for, search_option
from schedules.hand_orders import interleaved_zb_loop
from schedules.table import Table

__all__ = ["interleaved_zb"]


def interleaved_zb(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """Zero bubble with ``stages_per_rank=v`` (default 2) stages per rank placed as in
    interleaved-1f1b (stage s on rank s mod p, p = num_stages / v), B and W apart. Without costs
    the order is built for F = B = W (a stage of a rank holding v costs 1/v); ``costs`` and
    ``max_live`` build it for other times (``schedules.from_costs``); either way PyTorch's
    interleaved zero-bubble loop (``schedules.hand_orders``) is among the candidates. Each rank holds at most
    ``max_live`` stage-microbatches, by default v·p (PyTorch's ScheduleInterleavedZeroBubble holds
    as many). Any m >= 1.

    p=2, v=2 (4 stages), m=2, F=B=W (``render_ascii``)::

       0   1   2   3   4   5   6   7   8   9   10  11  12
    r0 0F0 0F1 2F0 2F1 .   2B0 2W0 0B0 2B1 0W0 0B1 0W1 2W1
    r1 .   1F0 1F1 3F0 3B0 3F1 1B0 3B1 1W0 1B1 1W1 3W0 3W1
    """
    check_counts("interleaved-zb", num_stages, num_microbatches)
    chosen = take_options("interleaved-zb", options,
                          {"stages_per_rank": 2, "costs": None, "max_live": None, "search": True})
    v = positive_int("interleaved-zb", "stages_per_rank", chosen.pop("stages_per_rank"))
    if num_stages % v:
        valid = [d for d in range(1, num_stages + 1) if num_stages % d == 0]
        raise ScheduleError(
            f"interleaved-zb: {num_stages} stages do not split into stages_per_rank={v} per rank; "
            f"use stages_per_rank in {valid} or {num_stages + v - num_stages % v} stages")
    p = num_stages // v
    placement = tuple(s % p for s in range(num_stages))
    unit = tuple((1.0 / v,) * num_stages for _ in range(3)) + ((0.0,) * num_stages,)
    loop = interleaved_zb_loop(p, v, num_microbatches)  # PyTorch's order: a candidate, never lost
    seeds = (loop,) if loop is not None else ()
    fixed = build_from_costs(placement, num_microbatches, unit, (v * p,) * p, seeds,  # type: ignore[arg-type]
                             search=search_option("interleaved-zb", chosen))
    return order_for("interleaved-zb", fixed, chosen, default_live=(v * p,) * p, seeds=seeds)
