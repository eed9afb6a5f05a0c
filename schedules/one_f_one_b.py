"""1F1B: one forward, one backward in the steady state (PipeDream-Flush, Megatron-LM)."""

from __future__ import annotations

from schedules._params import check_counts, take_options
from schedules._phased import one_stage_per_rank
from schedules.table import Table

__all__ = ["one_f_one_b"]


def one_f_one_b(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """1F1B on ``num_stages`` ranks, stage s on rank s; rank r warms up with p-1-r forwards.

    Same idle share as GPipe, (p-1)/(m+p-1), but rank r holds only min(m, p-r) microbatches.
    p=3, m=4, F=1, BW=2 (``render_ascii``)::

       0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17
    r0 0F0  0F1  0F2  .    .    .    .    0BW0 ---- 0F3  0BW1 ---- .    0BW2 ---- .    0BW3 ----
    r1 .    1F0  1F1  .    .    1BW0 ---- 1F2  1BW1 ---- 1F3  1BW2 ---- .    1BW3 ---- .    .
    r2 .    .    2F0  2BW0 ---- 2F1  2BW1 ---- 2F2  2BW2 ---- 2F3  2BW3 ---- .    .    .    .
    """
    check_counts("1f1b", num_stages, num_microbatches)
    take_options("1f1b", options, {})
    return one_stage_per_rank(num_stages, num_microbatches, lambda rank: num_stages - 1 - rank)
