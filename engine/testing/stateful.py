"""The reference of a loss function with a deferred aux (ir.deferred: BatchNorm in train mode as state).

Its loss and grads are the average, over the step's `parts` = microbatches x dp equal microbatches, of
`torch.func.grad_and_value` of the microbatch half on each (batch statistics are per microbatch; a loss
averaged over counted targets weights each microbatch by its count, as the step does); its
state is the finish of the microbatch halves' averaged partial statistics. Integer leaves (a BatchNorm's
num_batches_tracked) have no gradient: their expected grad is None and they are not compared.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

import ir

__all__ = ["Reference", "reference"]

Reference = tuple[torch.Tensor, Any, Any]  # (loss, grads with None for integer leaves, state)


def reference(fn: Callable, params: Any, batch: Sequence[Any], parts: int,
              weights: Sequence[float] | None = None) -> Reference:
    """`(loss, grads, state)` of a deferred `fn` run as `parts` microbatches (see the module docstring);
    `weights`: each microbatch's share of the loss and grads where it is not 1 / parts (a cross-entropy with
    ignore_index: `engine.execution.loss_weights`); the partial statistics stay averaged."""
    halves = ir.deferred_of(fn)
    if halves is None:
        raise TypeError(f"{getattr(fn, '__name__', fn)} is not a deferred function (ir.deferred)")
    leaves, tree = pytree.tree_flatten(params)
    floats = [i for i, x in enumerate(leaves) if x.is_floating_point()]

    def local(diff: list[torch.Tensor], *b: Any) -> tuple[torch.Tensor, Any]:
        full = list(leaves)
        for i, x in zip(floats, diff):
            full[i] = x
        return halves.local(pytree.tree_unflatten(full, tree), *b)

    total: list[Any] | None = None
    shares = list(weights) if weights is not None else [1.0 / parts] * parts
    for chunk, share in zip(_chunks(batch, parts), shares):
        grads, (loss, partial) = torch.func.grad_and_value(local, has_aux=True)([leaves[i] for i in floats], *chunk)
        flat = [x * share for x in (loss.detach(), *grads)] + [x.detach() / parts for x in pytree.tree_leaves(partial)]
        total = flat if total is None else [a + b for a, b in zip(total, flat)]
        spec = pytree.tree_structure(partial)
    assert total is not None
    mean = total
    loss, grads, partial = mean[0], mean[1:1 + len(floats)], mean[1 + len(floats):]
    out: list[Any] = [None] * len(leaves)
    for i, g in zip(floats, grads):
        out[i] = g
    return loss, pytree.tree_unflatten(out, tree), halves.finish(pytree.tree_unflatten(partial, spec), parts)


def chunks(batch: Sequence[Any], parts: int) -> list[list[torch.Tensor]]:
    """The batch's flat leaves cut into `parts` microbatches, as the step cuts them."""
    return [pytree.tree_leaves(c) for c in _chunks(batch, parts)]


def _chunks(batch: Sequence[Any], parts: int) -> list[tuple[Any, ...]]:
    leaves, tree = pytree.tree_flatten(tuple(batch))
    cut = [torch.tensor_split(x, parts, dim=0) for x in leaves]
    return [tuple(pytree.tree_unflatten([c[k] for c in cut], tree)) for k in range(parts)]
