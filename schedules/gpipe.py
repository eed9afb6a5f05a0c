"""GPipe: all forwards, then all backwards (Huang et al., 2019)."""

from __future__ import annotations

from schedules._params import check_counts, take_options
from schedules._phased import one_stage_per_rank
from schedules.table import Table

__all__ = ["gpipe"]


def gpipe(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """GPipe on ``num_stages`` ranks, stage s on rank s; every rank holds all microbatches.

    p=3, m=4, F=1, BW=2 (``render_ascii``; idle share (p-1)/(m+p-1) = 1/3)::

       0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17
    r0 0F0  0F1  0F2  0F3  .    .    .    .    .    .    0BW0 ---- 0BW1 ---- 0BW2 ---- 0BW3 ----
    r1 .    1F0  1F1  1F2  1F3  .    .    .    1BW0 ---- 1BW1 ---- 1BW2 ---- 1BW3 ---- .    .
    r2 .    .    2F0  2F1  2F2  2F3  2BW0 ---- 2BW1 ---- 2BW2 ---- 2BW3 ---- .    .    .    .
    """
    check_counts("gpipe", num_stages, num_microbatches)
    take_options("gpipe", options, {})
    return one_stage_per_rank(num_stages, num_microbatches, lambda _: num_microbatches)
