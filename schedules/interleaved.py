"""Interleaved 1F1B: v stages per rank, visited round-robin (Megatron-LM, Narayanan et al. 2021)."""

from __future__ import annotations

from schedules._params import check_counts, positive_int, take_options
from schedules._phased import phased_row
from schedules.action import BW, Action, F
from schedules.errors import ScheduleError
from schedules.table import Table

__all__ = ["interleaved_1f1b"]


def interleaved_1f1b(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """Interleaved 1F1B with ``stages_per_rank=v`` (default 2): p = num_stages / v ranks, stage s
    on rank s mod p. Microbatches go in groups of p; within a group each rank runs its first
    stage for all p, then its second, and so on (backwards visit the stages in reverse). Rank r
    warms up with 2(p-1-r) + (v-1)p forwards (p-1-r when v = 1: plain 1F1B). Needs m to be a
    multiple of p. Idle share (p-1)/(v*m+p-1); rank 0 holds up to v*p+p-1 stage-microbatches.

    p=2, v=2 (4 stages), m=2, F=1, BW=2 (``render_ascii``)::

       0    1    2    3    4    5    6    7    8    9    10   11   12   13   14
    r0 0F0  0F1  2F0  2F1  .    .    2BW0 ---- .    2BW1 ---- 0BW0 ---- 0BW1 ----
    r1 .    1F0  1F1  3F0  3BW0 ---- 3F1  3BW1 ---- 1BW0 ---- 1BW1 ---- .    .
    """
    check_counts("interleaved-1f1b", num_stages, num_microbatches)
    chosen = take_options("interleaved-1f1b", options, {"stages_per_rank": 2})
    v = positive_int("interleaved-1f1b", "stages_per_rank", chosen["stages_per_rank"])
    p = _ranks(num_stages, num_microbatches, v)
    rows = []
    for r in range(p):
        order = [_virtual(k, p, v) for k in range(v * num_microbatches)]
        rows.append(phased_row(
            [Action(chunk * p + r, F, mb) for chunk, mb in order],
            [Action((v - 1 - chunk) * p + r, BW, mb) for chunk, mb in order],
            warmup=p - 1 - r if v == 1 else 2 * (p - 1 - r) + (v - 1) * p,
        ))
    return Table(num_stages, num_microbatches, tuple(s % p for s in range(num_stages)), rows)


def _virtual(k: int, p: int, v: int) -> tuple[int, int]:
    """(chunk, microbatch) of a rank's k-th forward: groups of p microbatches, chunk by chunk."""
    group, within = divmod(k, p * v)
    chunk, offset = divmod(within, p)
    return chunk, group * p + offset


def _ranks(num_stages: int, num_microbatches: int, v: int) -> int:
    if num_stages % v:
        valid = [d for d in range(1, num_stages + 1) if num_stages % d == 0]
        raise ScheduleError(
            f"interleaved-1f1b: {num_stages} stages do not split into stages_per_rank={v} per "
            f"rank; use stages_per_rank in {valid} or {num_stages + v - num_stages % v} stages"
        )
    p = num_stages // v
    if num_microbatches % p:
        lower = num_microbatches - num_microbatches % p
        options = [n for n in (lower, lower + p) if n > 0]
        raise ScheduleError(
            f"interleaved-1f1b: num_microbatches={num_microbatches} is not a multiple of the {p} "
            f"ranks (like Megatron-LM, microbatches go round in groups of p); use "
            f"{' or '.join(map(str, options))}"
        )
    return p
