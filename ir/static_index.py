"""Boolean-mask indices that are constants become integer indices, so their gradients have static shapes.

`x[mask]` and `x.index_put_((mask,), v)` with a mask closed over by the function (a constant of the
graph) are shape-static: the mask's value is known at trace time. Their backward formulas index by the
mask again, which PyTorch computes with `nonzero`, a data-dependent shape that a fake-tensor trace of the
backward refuses. PyTorch's own indexing turns a boolean mask into the integer indices of its nonzeros
(`mask.nonzero().unbind(1)`) before indexing; doing that here, on the constant, gives the same values
and grads with the shapes known. A mask that is a graph input or computed is left alone (its shape
depends on the data: `ir.trace` refuses it with its own message).
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from .core import Eqn, Graph, Literal

OPS = {"aten.index.Tensor": 1, "aten.index_put.default": 1, "aten._unsafe_index.Tensor": 1,
       "aten._unsafe_index_put.default": 1}  # op -> position of its indices list


def _static_mask(x: Any) -> bool:
    return isinstance(x, Literal) and isinstance(x.value, torch.Tensor) and x.value.dtype in (torch.bool, torch.uint8)


def _expand(indices: Any) -> list[Any]:
    out: list[Any] = []
    for x in indices:
        if _static_mask(x):
            out.extend(Literal(i) for i in x.value.bool().nonzero(as_tuple=True))
        else:
            out.append(x)
    return out


def _rewrite(e: Eqn) -> Eqn:
    pos = OPS.get(e.op)
    if pos is None or len(e.args) <= pos or not any(_static_mask(x) for x in (e.args[pos] or ())):
        return e
    args = list(e.args)
    args[pos] = _expand(args[pos])
    return attrs.evolve(e, args=tuple(args))


def static_mask_indices(g: Graph) -> Graph:
    """`g` with every constant boolean mask in an index list replaced by its nonzeros' integer indices."""
    return attrs.evolve(g, eqns=tuple(_rewrite(e) for e in g.eqns))
