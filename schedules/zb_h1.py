"""ZB-H1: 1F1B with split backward, W passes delayed to fill the bubbles (Qi et al., 2024)."""

from __future__ import annotations

import functools

from schedules._params import check_counts, take_options
from schedules._phased import one_stage_per_rank
from schedules.from_costs import order_for
from schedules.table import Table

__all__ = ["zb_h1"]


def zb_h1(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """ZB-H1 on ``num_stages`` ranks, stage s on rank s: 1F1B's warm-up and order of F and B,
    with rank r running each W r steps after its B. Later ranks thereby send their B's upstream
    sooner and the held-back W's fill the cool-down. With F = B = W the idle time is a third of
    1F1B's once m >= p; rank r holds at most p stage-microbatches (live from F until W).

    ``costs=(forward, backward_input, backward_weight[, transfer])`` (a number or one per stage
    each, or a ``schedules.Costs``) and ``max_live`` (per rank; default: what this order holds)
    build the order for those times instead (``schedules.from_costs``); ``search=False`` only
    times the hand-built orders under them (a planner's quick screen; the same holds for zbv,
    interleaved-zb and dualpipev).

    p=4, m=4, F=B=W=1 (``render_ascii``)::

       0   1   2   3   4   5   6   7   8   9   10  11  12  13  14
    r0 0F0 0F1 0F2 0F3 .   .   .   0B0 0W0 0B1 0W1 0B2 0W2 0B3 0W3
    r1 .   1F0 1F1 1F2 .   .   1B0 1F3 1B1 1W0 1B2 1W1 1B3 1W2 1W3
    r2 .   .   2F0 2F1 .   2B0 2F2 2B1 2F3 2B2 2W0 2B3 2W1 2W2 2W3
    r3 .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3W1 3W2 3W3
    """
    check_counts("zb-h1", num_stages, num_microbatches)
    chosen = take_options("zb-h1", options, {"costs": None, "max_live": None, "search": True})
    return order_for("zb-h1", _fixed(num_stages, num_microbatches), chosen)


@functools.lru_cache(maxsize=64)  # a planner builds the order from costs for every split it tries: seed once
def _fixed(num_stages: int, num_microbatches: int) -> Table:
    return one_stage_per_rank(num_stages, num_microbatches, warmup=lambda rank: num_stages - 1 - rank,
                              weight_lag=lambda rank: rank)
