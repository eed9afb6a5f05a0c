"""A loss that compares the batch's rows with each other is never cut into microbatches or dp shares.

The step averages the losses of the parts it cuts the batch into (microbatches x dp replicas): the batch's
loss for a mean of per-row terms, not for a loss that compares rows (CLIP's contrastive loss, Mixtral's
router load balancing): CLIP in 4 microbatches of 2 gave 1.2218 where the batch's loss is 2.7177. Planning
asks `ir.mixed_rows` of the traced graph whenever a layout would cut the batch. With the counts given
(`microbatches=8`, `dp=2`), such a loss raises InputError naming the op, its line and the fix, on every
rank alike (each traces the same graph) and before any communication of the step; with "auto" counts the
planner keeps only the layouts that run the whole batch as one microbatch of one replica.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

import ir

from ..errors import InputError
from .layout import Layout

if TYPE_CHECKING:
    from .artifacts import Workshop
    from .plan import Plan

__all__ = ["FIX", "check_plan", "refusal", "splits", "unsplit"]

log = logging.getLogger("engine.plan")

FIX = ("Fix: run it on the whole batch, parallelize(..., microbatches=1, dp=1) (pipeline stages still split the "
       "model), or make the loss a mean of per-row terms")


def splits(layout: Layout) -> bool:
    """The layout cuts the batch (several microbatches or dp replicas)."""
    return layout.dp * layout.microbatches > 1


def refusal(mix: ir.MixedRows, *, batch_size: int, dp: int, microbatches: int) -> InputError:
    """The InputError for a loss that mixes rows, cut into dp x microbatches parts."""
    return InputError(
        f"the loss compares rows of the batch with each other, so cutting its {batch_size} rows into {dp} dp "
        f"replica{'s' if dp != 1 else ''} x {microbatches} microbatch{'es' if microbatches != 1 else ''} would give "
        "wrong numbers: the step averages the parts' losses, which is the batch's loss only for a mean (or "
        f"sum) of per-row terms.\n{mix}\n{FIX}")


def _given(value: Any) -> bool:
    """A count the user gave that cuts the batch (an int above 1; None and "auto" leave the planner free)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def unsplit(workshop: Workshop, layouts: Sequence[Layout], batch_size: int, *, microbatches: Any, dp: Any
            ) -> list[Layout]:
    """`layouts`, or for a loss that mixes rows those that keep the batch whole (one microbatch, dp 1: the
    "auto" counts lowered to them); InputError when a given count cuts the batch, or no layout keeps it whole."""
    cut = [lay for lay in layouts if splits(lay)]
    if not cut:
        return list(layouts)
    mix = workshop.mixed_rows(max(lay.microbatch_size(batch_size) for lay in cut))
    if mix is None:
        return list(layouts)
    whole = list(dict.fromkeys(attrs.evolve(lay, microbatches=1) for lay in layouts
                               if lay.dp == 1 and not lay.replicated))
    if _given(microbatches) or _given(dp) or not whole:
        first = cut[0]
        raise refusal(mix, batch_size=batch_size, dp=first.dp, microbatches=first.microbatches)
    log.info("the loss compares rows of the batch (%s): planning one microbatch, dp 1", mix)
    return whole


def check_plan(workshop: Workshop, plan: Plan, size: int) -> None:
    """InputError for a plan made elsewhere (a plan cache, by hand) that cuts the batch of a loss that mixes
    rows into microbatches of `size` rows."""
    if plan.dp * plan.microbatches <= 1:
        return
    mix = workshop.mixed_rows(size)
    if mix is not None:
        raise refusal(mix, batch_size=size * plan.dp * plan.microbatches, dp=plan.dp, microbatches=plan.microbatches)
