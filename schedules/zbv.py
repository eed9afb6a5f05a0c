"""ZB-V: two stages per rank in a V, split backward, greedily ordered (Qi et al., 2024)."""

from __future__ import annotations

import functools

from schedules._greedy import greedy_table
from schedules._params import check_counts, take_options
from schedules.action import Action, B, F, W
from schedules.errors import ScheduleError
from schedules.from_costs import order_for
from schedules.hand_orders import zbv_order
from schedules.table import Table

__all__ = ["zbv"]

# Finish what is nearest to done first: B of the rank's first stage (frees a microbatch),
# F of its second stage (towards the loss), B of its second stage, new forwards; W fills gaps.
_URGENCY = {(B, 0): 0, (F, 1): 1, (B, 1): 2, (F, 0): 3, (W, 0): 4, (W, 1): 4}


def zbv(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """ZB-V with p = num_stages / 2 ranks; rank r holds stages r and 2p-1-r, so the forward runs
    down the ranks and back up, and the loss is on rank 0. Each rank starts its most urgent
    ready action (B first stage, F second stage, B second stage, F first stage, then W), keeping
    at most 2p stage-microbatches live (the memory of 1F1B's rank 0). With F = B = W every rank
    idles only p-1 time units once m >= 2p, the least possible. ``costs`` and ``max_live``
    (default 2p) build the order for other times (``schedules.from_costs``; see ``zb_h1``), PyTorch's ZBV
    order (``schedules.hand_orders``) among the candidates.

    p=2 (4 stages), m=3, F=B=W=1 (``render_ascii``)::

       0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18
    r0 0F0 0F1 0F2 3F0 3B0 3W0 3F1 0B0 3B1 0W0 3W1 0B1 0W1 3F2 3B2 3W2 .   0B2 0W2
    r1 .   1F0 2F0 1F1 2F1 2B0 1B0 1W0 1F2 2B1 1B1 2W0 2F2 1W1 2W1 2B2 1B2 1W2 2W2
    """
    check_counts("zbv", num_stages, num_microbatches)
    chosen = take_options("zbv", options, {"costs": None, "max_live": None, "search": True})
    if num_stages % 2:
        raise ScheduleError(
            f"zbv places 2 stages per rank in a V, so num_stages must be even (got {num_stages});"
            f" use {num_stages - 1 or 2} or {num_stages + 1}"
        )
    p = num_stages // 2
    fixed = _greedy(p, num_microbatches)
    return order_for("zbv", fixed, chosen, default_live=[2 * p] * p, seeds=(zbv_order(p, num_microbatches),))


@functools.lru_cache(maxsize=64)  # a planner builds the order from costs for every split it tries: seeds once
def _greedy(p: int, num_microbatches: int) -> Table:
    """The fixed order: the greedy over urgencies with F = B = W."""

    def urgency(action: Action) -> tuple[int, int]:
        return _URGENCY[(action.kind, int(action.stage >= p))], action.microbatch

    placement = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return greedy_table(placement, num_microbatches, live_limit=[2 * p] * p, priority=urgency)
