"""Looped BFS: v stages per rank, each stage runs all its microbatches before the next (Lamy-Poirier, 2022)."""

from __future__ import annotations

from schedules._params import check_counts, positive_int, take_options
from schedules.action import BW, Action, F
from schedules.errors import ScheduleError
from schedules.table import Table

__all__ = ["looped_bfs"]


def looped_bfs(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """Breadth-first pipeline with ``stages_per_rank=v`` (default 2): p = num_stages / v ranks,
    stage s on rank s mod p (a loop, like interleaved-1f1b). Each rank runs the forwards of its
    first stage for every microbatch, then of its second, and so on; then the backwards of its
    stages in reverse, each for the microbatches newest first (the last forward's grad is the first
    to come back). It holds every microbatch of every stage (v·m live, GPipe's memory) and idles
    (p-1)/(v·m+p-1) of the step with BW = 2F, like interleaved 1F1B; it suits data parallelism
    sharded across the loop, where a stage's weights are gathered once per step.

    p=2, v=2 (4 stages), m=2, F=1, BW=2 (``render_ascii``)::

       0    1    2    3    4    5    6    7    8    9    10   11   12   13   14
    r0 0F0  0F1  2F0  2F1  .    .    .    2BW1 ---- 2BW0 ---- 0BW1 ---- 0BW0 ----
    r1 .    1F0  1F1  3F0  3F1  3BW1 ---- 3BW0 ---- 1BW1 ---- 1BW0 ---- .    .
    """
    check_counts("looped-bfs", num_stages, num_microbatches)
    chosen = take_options("looped-bfs", options, {"stages_per_rank": 2})
    v = positive_int("looped-bfs", "stages_per_rank", chosen["stages_per_rank"])
    if num_stages % v:
        valid = [d for d in range(1, num_stages + 1) if num_stages % d == 0]
        raise ScheduleError(
            f"looped-bfs: {num_stages} stages do not split into stages_per_rank={v} per rank; "
            f"use stages_per_rank in {valid} or {num_stages + v - num_stages % v} stages")
    p, m = num_stages // v, num_microbatches
    rows = []
    for r in range(p):
        mine = range(r, num_stages, p)
        forwards = [Action(s, F, i) for s in mine for i in range(m)]
        backwards = [Action(s, BW, i) for s in reversed(mine) for i in reversed(range(m))]
        rows.append(forwards + backwards)
    return Table(num_stages, m, tuple(s % p for s in range(num_stages)), rows)
