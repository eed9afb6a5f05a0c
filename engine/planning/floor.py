"""The microbatch floor: the planner never splits a batch into microbatches smaller than `min_microbatch_size`.

Statistics over a microbatch (BatchNorm in train mode normalises each microbatch with its own mean and
variance) are noise below some size, so a faster pipeline with more, smaller microbatches is not the
same training. The floor is `min_microbatch_size` when given; otherwise the function's own (a deferred
function says it: BatchNorm in train mode asks for 16 rows, see engine/training/batchnorm.py), capped by
the batch per replica so a small batch still plans (one microbatch per replica then); 1 for the rest.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import ir

from ..errors import PlanError
from .layout import Layout

__all__ = ["above_floor", "floor_of"]


def floor_of(fn: Callable, min_microbatch_size: int | None) -> tuple[int, str]:
    """The floor and where it comes from (for messages): the option, the function's, or none."""
    if min_microbatch_size is not None:
        if isinstance(min_microbatch_size, bool) or not isinstance(min_microbatch_size, int) or min_microbatch_size < 1:
            raise PlanError(f"min_microbatch_size must be a positive int (rows per microbatch) or None; "
                            f"got {min_microbatch_size!r}")
        return min_microbatch_size, f"min_microbatch_size={min_microbatch_size}"
    halves = ir.deferred_of(fn)
    if halves is not None and halves.min_microbatch > 1:
        return halves.min_microbatch, (f"the default min_microbatch_size={halves.min_microbatch} of {halves.why}; "
                                       "pass min_microbatch_size=N to choose another")
    return 1, ""


def above_floor(layouts: Sequence[Layout], batch_size: int, floor: int, why: str, *, auto: bool = True
                ) -> list[Layout]:
    """The layouts whose microbatches have at least `floor` rows (capped by the batch per replica). With
    the microbatch count on "auto", a (depth, dp) whose every count fell below gets the largest count that
    stays above (fewer microbatches than stages: a bubble, but the statistics the user asked for); with a
    count given, PlanError naming the counts that would do when no layout is left."""
    keep = [lay for lay in layouts if lay.microbatch_size(batch_size) >= _needed(lay, batch_size, floor)]
    if auto:
        have = {(lay.pipeline_depth, lay.stages_per_rank, lay.dp) for lay in keep}
        for p, v, dp in dict.fromkeys((lay.pipeline_depth, lay.stages_per_rank, lay.dp) for lay in layouts):
            if (p, v, dp) not in have:
                rows = batch_size // dp
                m = max(d for d in range(1, rows + 1) if rows % d == 0 and rows // d >= min(floor, rows))
                keep.append(Layout(p, v, dp, m))
    if keep or not layouts:
        return keep
    sizes = sorted({(lay.dp, lay.microbatches, lay.microbatch_size(batch_size)) for lay in layouts})
    shown = ", ".join(f"dp {d} x {m} microbatches = {s} rows" for d, m, s in sizes[:4])
    fits = sorted({max(1, batch_size // lay.dp // floor) for lay in layouts})
    raise PlanError(f"every layout splits the batch of {batch_size} below {floor} rows per microbatch ({shown}); "
                    f"the floor is {why}. Use fewer microbatches (at most {fits} per replica for these dp), "
                    "a larger batch, or a lower min_microbatch_size")


def _needed(layout: Layout, batch_size: int, floor: int) -> int:
    return min(floor, batch_size // layout.dp)
