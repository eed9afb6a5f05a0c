"""`index_fill` with a tensor value, run through a mask in the joint trace: the backward's shapes are static.

PyTorch's derivative of `index_fill(self, dim, index, value)` with respect to a tensor `value` sums the
grad over `index_select(dim, _unique(index))`; `_unique` has a data-dependent shape, which a fake-tensor
trace of the backward refuses (PyTorch's own make_fx of the grad fails the same way). Filling through a
mask, `where(zeros.index_fill(dim, index, True), value, self)`, gives the same values, and its backward (a
`where` and a sum) has static shapes and counts a repeated index once, as `_unique` does. Only the joint
trace of stage autodiff runs the masked form (`masked_fills`); the traced graph keeps PyTorch's op.
"""
from __future__ import annotations

import attrs
import torch

from .core import Graph

_OP = "aten.index_fill.int_Tensor"
MASKED = "fnpipe.index_fill_masked.default"

_LIB = torch.library.Library("fnpipe", "DEF")
_LIB.define("index_fill_masked(Tensor self, int dim, Tensor index, Tensor value) -> Tensor")


def _index_fill_masked(self: torch.Tensor, dim: int, index: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(self.shape, dtype=torch.bool, device=self.device).index_fill(dim, index, True)
    return torch.where(mask, value.to(self.dtype), self)


# CompositeImplicitAutograd: autograd (and make_fx) see the zeros / index_fill / where it is made of
_LIB.impl("index_fill_masked", _index_fill_masked, "CompositeImplicitAutograd")


def masked_fills(g: Graph) -> Graph:
    """`g` with each `index_fill` by a tensor value in its masked form (the same values)."""
    if not any(e.op == _OP for e in g.eqns):
        return g
    return attrs.evolve(g, eqns=tuple(attrs.evolve(e, op=MASKED) if e.op == _OP else e for e in g.eqns))
