"""Per-microbatch loss weights for a loss that averages over the targets a batch counts (`ir.token_mean`).

The executor adds each microbatch's loss as 1 / (microbatches x dp) of it and seeds its backward with the
same: the batch's loss when every microbatch's loss is a mean over as many rows. A cross-entropy with
`ignore_index` (padding marked -100) divides by the targets each microbatch counts, so with counts c_i of
N in all the batch's loss is sum_i (c_i / N) loss_i: those are the weights. Every rank computes them from
the whole batch it was given (no communication), before the step runs.

Counts that differ where the weights cannot make the step exact (the mean combined with other terms), and
a microbatch that counts no target (its mean is 0 / 0), raise InputError on every rank, naming the fix.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ir.token_mean import TokenMean

from ..errors import InputError

__all__ = ["loss_weights"]


def _shown(counts: Sequence[int]) -> str:
    head = ", ".join(map(str, counts[:8]))
    return head + (f", ... ({len(counts)} in all)" if len(counts) > 8 else "")


def loss_weights(mean: TokenMean | None, chunks: Sequence[Sequence[torch.Tensor]]
                 ) -> list[float] | torch.Tensor | None:
    """Each microbatch's weight (all of the batch's `chunks`, dp replicas in order), or None when the uniform
    1 / len(chunks) is exact (no counted-target mean, or every microbatch counts as many targets). A batch on
    an accelerator under an exact mean gets the weights as a tensor there, made without a sync (the previous
    step's work may still run): a microbatch that counts no target then gives a NaN loss, as its own mean
    does, where a batch on the CPU raises InputError. The other cases read the counts on the host."""
    if mean is None or len(chunks) == 1:
        return None
    if mean.weighted:
        raise InputError(f"the loss averages {_op(mean)} with class weights: each microbatch divides by the sum of "
                         "its own targets' weights, so the mean of the microbatches' losses is not the batch's. Use "
                         "microbatches=1 and dp=1, or return the weighted sum divided by the batch's total weight")
    counts = mean.counts(chunks)
    if counts.device.type != "cpu" and mean.exact:
        return counts[0].double() / counts[0].sum()
    return _checked(mean, counts.tolist())


def _op(mean: TokenMean) -> str:
    return mean.op.removeprefix("aten.").split(".")[0]


def _checked(mean: TokenMean, counts: list[list[int]]) -> list[float] | None:
    uneven = [row for row in counts if len(set(row)) > 1]
    if not uneven:
        return None
    row = uneven[0]
    why = (f"the loss averages {_op(mean)} over the targets that are not ignore_index={mean.ignore_index}, and the "
           f"microbatches count {_shown(row)} of them")
    if not mean.exact:
        several = " (one of its several counted means)" if len(counts) > 1 else ""
        raise InputError(f"{why}{several}, and the loss combines that mean with other terms, so the mean of the "
                         "microbatches' losses is not the batch's. Return the counted mean alone (times constants: "
                         "fnpipe then weights each microbatch by its count), or a sum over targets divided by the "
                         "batch's count")
    if 0 in row:
        raise InputError(f"{why}: microbatch {row.index(0)} counts none, so its mean is 0 / 0. Shuffle the "
                         "padded rows among the microbatches, use fewer microbatches, or return the sum over "
                         "targets divided by the batch's count (as transformers' num_items_in_batch does)")
    total = float(sum(row))
    return [c / total for c in row]
