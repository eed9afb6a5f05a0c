"""index_fill with a tensor value: grads across a stage cut equal torch.func.grad (ir/static_fill.py)."""
from __future__ import annotations

import torch

import engine.testing
import ir
from ir.static_fill import masked_fills


def _fn(params: dict, x: torch.Tensor) -> torch.Tensor:
    index = torch.tensor([0, 2, 2])  # a repeated index: value's grad counts it once, as PyTorch's _unique does
    h = torch.tanh(params["w"] * x)
    return (h.index_fill(1, index, params["v"]) * params["u"]).sum()


def test_index_fill_by_a_tensor_differentiates_across_a_cut_like_func_grad() -> None:
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=g, dtype=torch.float64),
              "v": torch.tensor(0.7, dtype=torch.float64),
              "u": torch.randn(3, 4, generator=g, dtype=torch.float64)}
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    graph = ir.trace(_fn, params, x)
    assert any(e.op == "aten.index_fill.int_Tensor" for e in graph.eqns)  # the traced graph keeps PyTorch's op
    masked = masked_fills(graph)
    assert not any(e.op == "aten.index_fill.int_Tensor" for e in masked.eqns)
    assert torch.equal(ir.evaluate(masked, params, x), ir.evaluate(graph, params, x))
    n = len(graph.eqns)
    for cut in range(1, n):
        engine.testing.assert_parallel_equivalent(_fn, params, x, stages=2, cuts=[cut], microbatches=1)
