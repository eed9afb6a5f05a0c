"""Deferred aux: a loss function whose aux is finished once per step, after its per-microbatch parts are averaged.

A pipelined step runs the loss function once per microbatch and averages each aux leaf over the
microbatches (and dp replicas). That is right for a mean over the batch, and wrong for anything
non-linear in the batch, such as a variance: the running statistics of BatchNorm in train mode need
the full batch's mean and variance, which are not the averages of the microbatches' (the spread of the
microbatch means is missing). A deferred function splits the work:

    local(params, *batch) -> (loss, partial)     traced and run per microbatch; `partial`'s leaves are
                                                 averaged like any aux (so each must be linear in the batch)
    finish(partial, parts) -> aux                run once per step, on every rank, on the averaged partial;
                                                 `parts` is how many microbatches it is the average of

The function itself is `finish(local(...)[1], 1)` on the batch it is given, so calling it on one
process is the full-batch reference. `deferred(local, finish)` makes it; `deferred_of(fn)` finds the
parts again (the engine traces `local` and calls `finish` after the step's aux is reduced).
"""
from __future__ import annotations

from typing import Any, Callable

import attrs

ATTRIBUTE = "__fnpipe_deferred__"


@attrs.frozen
class Deferred:
    """The two halves of a deferred loss function (see the module docstring)."""

    local: Callable[..., tuple[Any, Any]]
    finish: Callable[[Any, int], Any]
    min_microbatch: int = 1  # rows per microbatch below which the partial statistics mean little
    why: str = ""            # what asks for that floor (for the planner's messages)


def deferred(local: Callable[..., tuple[Any, Any]], finish: Callable[[Any, int], Any], *,
             name: str | None = None, min_microbatch: int = 1, why: str = "") -> Callable[..., tuple[Any, Any]]:
    """The loss function `(params, *batch) -> (loss, finish(partial, 1))`, carrying its two halves."""

    def fn(params: Any, *batch: Any) -> tuple[Any, Any]:
        loss, partial = local(params, *batch)
        return loss, finish(partial, 1)

    fn.__name__ = name or getattr(local, "__name__", "loss_fn")
    setattr(fn, ATTRIBUTE, Deferred(local, finish, min_microbatch, why))
    return fn


def deferred_of(fn: Any) -> Deferred | None:
    """The halves of a function made by `deferred`, None for any other."""
    found = getattr(fn, ATTRIBUTE, None)
    return found if isinstance(found, Deferred) else None
