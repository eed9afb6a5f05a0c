"""Writes through views of fresh tensors are functionalized: values and 2-stage grads equal PyTorch's."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ir
from engine.testing import assert_parallel_equivalent
from engine.training.module import functionalize


def slice_assign(p, x, y):
    h = x @ p["w"]
    h[:, 1:] = torch.tanh(h[:, :-1])  # reads and writes views of one base
    return F.mse_loss(h @ p["v"], y)


def masked_fill_view(p, x, y):
    h = torch.sin(x @ p["w"])
    view = h[:, :2]
    view.masked_fill_(view > 0.5, 0.0)
    return F.mse_loss(h @ p["v"], y)


def index_put_(p, x, y):
    h = (x @ p["w"]).clone()
    h.index_put_((torch.tensor([0, 2]),), h[1] * 2.0)
    return F.mse_loss(h @ p["v"], y) + h[0].sum()


def copy_into_view(p, x, y):
    out = x.new_zeros(x.shape[0], 6)
    out[:, 1:5].copy_(x @ p["w"])
    out[:, 5:] = torch.tensor([0.25], dtype=torch.float64)  # a constant source
    out.narrow(1, 0, 1).fill_(1.0)
    return F.mse_loss(out[:, :4] @ p["v"], y)


def shift_right(p, x, y):
    """T5's `_shift_right`: a slice assignment into a fresh tensor, then a masked fill of it."""
    ids = x @ p["w"]
    shifted = ids.new_zeros(ids.shape)
    shifted[..., 1:] = ids[..., :-1].clone()
    shifted[..., 0] = 0.5
    shifted.masked_fill_(shifted == -100.0, 0.0)
    return F.mse_loss(shifted @ p["v"], y)


def attention_after_a_write(p, x, y):
    q = (x @ p["w"]).view(2, 4, 4)
    q[:, 0] = q[:, 0] * 2.0  # forces the functionalized trace
    a = F.scaled_dot_product_attention(q[None], q[None], q[None], is_causal=True)[0]
    return F.mse_loss(a.reshape(8, 4) @ p["v"], y)


CASES = [slice_assign, masked_fill_view, index_put_, copy_into_view, shift_right, attention_after_a_write]


def _args():
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(4, 4, generator=g, dtype=torch.float64), "v": torch.randn(4, 3, generator=g, dtype=torch.float64)}
    return p, torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
def test_values_and_grads_at_two_cuts(fn):
    p, x, y = _args()
    g = ir.trace(fn, p, x, y)
    assert not any(e.op.split(".")[1].endswith("_") for e in g.eqns)
    assert torch.allclose(ir.evaluate(g, p, x, y), fn(p, x, y), rtol=1e-12, atol=0)
    n = len(g.eqns)
    for cut in sorted({max(1, n // 3), max(1, 2 * n // 3)}):
        assert_parallel_equivalent(fn, p, x, y, stages=2, cuts=[cut], microbatches=1)


def test_attention_stays_one_op_when_functionalized():
    p, x, y = _args()
    ops = [e.op for e in ir.trace(attention_after_a_write, p, x, y).eqns]
    assert ops.count("aten.scaled_dot_product_attention.default") == 1 and "aten.select_scatter.default" in ops


class InPlaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h[:, :2] += 1.0  # in-place inside a module
        return F.relu_(h)


def test_in_place_inside_a_module():
    torch.manual_seed(0)
    model = nn.Sequential(InPlaceBlock(), nn.Linear(4, 3)).double()
    fn, variables = functionalize(model, loss=F.mse_loss)
    _, x, y = _args()
    assert_parallel_equivalent(fn, variables, x, y, stages=2, microbatches=2)


def test_writes_into_params_are_still_refused_through_a_view():
    def writes(p, x, y):
        h = x @ p["w"]
        h[:, 0] = 0.0  # needs functionalization ...
        p["w"][0, :2] = 1.0  # ... and writes a param through a view
        return F.mse_loss(h @ p["v"], y)

    with pytest.raises(ir.TraceError, match="mutates input 'w' in place") as caught:
        ir.trace(writes, *_args())
    assert 'p["w"][0, :2] = 1.0' in str(caught.value)
