"""A boolean mask closed over by the loss indexes with static shapes: grads across stages equal torch.func.grad."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ir
from engine.testing import assert_parallel_equivalent

MASK = torch.tensor([True, False, True, True, False, True, False, True])


def masked_rows(p, x, y):
    """index_put by a constant mask has a static shape forward (the shape of h); its backward indexes by the
    mask, which only the rewrite to integer indices keeps static. (`h[mask]` itself has a shape from the
    mask's values: make_fx refuses it on fake tensors, as ir.trace does.)"""
    h = torch.tanh(x @ p["w"])             # [8, 6]
    filled = h.index_put((MASK,), p["v"] * h[0])
    return F.mse_loss(filled.sum(-1), y)


def _args():
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(5, 6, generator=g, dtype=torch.float64), "v": torch.randn(6, generator=g, dtype=torch.float64)}
    return p, torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)


def test_constant_masks_become_integer_indices_and_differentiate_across_stages():
    p, x, y = _args()
    g = ir.trace(masked_rows, p, x, y)
    index_args = [a for e in g.eqns if e.op == "aten.index_put.default" for a in e.args[1]]
    assert len(index_args) == 1 and index_args[0].value.tolist() == [0, 2, 3, 5, 7]
    assert torch.equal(ir.evaluate(g, p, x, y), masked_rows(p, x, y))
    for cut in range(1, len(g.eqns)):
        assert_parallel_equivalent(masked_rows, p, x, y, stages=2, cuts=[cut], microbatches=1)
