"""The harness's cache of Workshops: tracing and stage autodiff cost far more than a tiny model's step."""
from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

import ir

from ..planning.artifacts import Workshop

WORKSHOPS_SIZE = 64


class _LRU(collections.OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return value


_WORKSHOPS = _LRU(WORKSHOPS_SIZE)


def _avals(tree: Any) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten(tree)
    return (spec, *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves))


def workshop_of(fn: Callable, params: Any, batch: Sequence[Any]) -> Workshop:
    """The CPU Workshop of `fn` on arguments of these shapes and dtypes (`batch`: the full batch), kept
    across checks, so every microbatch size is traced once and every stage differentiated once."""
    return _WORKSHOPS.get_or((fn, _avals((params, *batch))), lambda: Workshop(fn, params, batch, device="cpu",
                                                                          has_aux=ir.deferred_of(fn) is not None))


def graph_of(fn: Callable, params: Any, batch: Sequence[Any], parts: int = 1) -> ir.Graph:
    """The graph of one of `parts` equal microbatches of `batch` (the whole of it by default)."""
    rows = int(pytree.tree_leaves(tuple(batch))[0].shape[0])
    return workshop_of(fn, params, batch).graph(rows // parts)
