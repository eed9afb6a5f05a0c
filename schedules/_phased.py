"""Warm-up, one-forward-one-backward, cool-down: the row order of GPipe, 1F1B and ZB-H1."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from schedules.action import BW, Action, B, F, W
from schedules.table import Table

__all__ = ["one_stage_per_rank", "phased_row"]


def phased_row(
    forwards: Sequence[Action],
    backwards: Sequence[Action],
    warmup: int,
    weights: Sequence[Action] = (),
    weight_lag: int = 0,
) -> tuple[Action, ...]:
    """``warmup`` forwards; then one forward (while any are left) and one backward per step,
    plus, from step ``weight_lag`` on, the oldest weight pass; then the weight passes left.

    ``warmup >= len(forwards)`` gives GPipe's all-forwards-then-all-backwards.
    """
    assert len(forwards) == len(backwards) and len(weights) in (0, len(backwards))
    warmup = min(warmup, len(forwards))
    row = list(forwards[:warmup])
    for k, backward in enumerate(backwards):
        if warmup + k < len(forwards):
            row.append(forwards[warmup + k])
        row.append(backward)
        if weights and k >= weight_lag:
            row.append(weights[k - weight_lag])
    row += weights[max(0, len(weights) - weight_lag):] if weights else ()
    return tuple(row)


def one_stage_per_rank(
    num_stages: int,
    num_microbatches: int,
    warmup: Callable[[int], int],
    weight_lag: Callable[[int], int] | None = None,
) -> Table:
    """Stage s on rank s, running ``phased_row`` with ``warmup(s)`` forwards first.

    Without ``weight_lag`` the backward is one BW action; with it, B and W are split and rank
    s runs each W ``weight_lag(s)`` steps after its B.
    """
    microbatches = range(num_microbatches)
    rows = [
        phased_row(
            [Action(s, F, i) for i in microbatches],
            [Action(s, BW if weight_lag is None else B, i) for i in microbatches],
            warmup(s),
            weights=[] if weight_lag is None else [Action(s, W, i) for i in microbatches],
            weight_lag=0 if weight_lag is None else weight_lag(s),
        )
        for s in range(num_stages)
    ]
    return Table(num_stages, num_microbatches, tuple(range(num_stages)), rows)
