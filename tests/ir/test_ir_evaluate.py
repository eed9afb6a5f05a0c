"""ir.trace then ir.evaluate recomputes fn exactly, compiled and interpreted; pytrees and names survive."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from ir_cases import examples, trace_case
from torch.utils import _pytree as pytree

import ir
from engine.testing import models


@settings(max_examples=examples(60))
@given(models(dtypes=(torch.float64, torch.float32, torch.bfloat16), max_layers=8))
def test_evaluate_equals_fn_bitwise(case):
    """The graph runs the same ATen ops as eager, so every dtype agrees bit for bit."""
    graph = trace_case(case)
    ir.check(graph)
    expected = case.fn(case.params, *case.batch)
    for compiled in (True, False):
        got = ir.evaluate(graph, case.params, *case.batch, compiled=compiled)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (compiled, got, expected)


def _tree_fn(params, batch, extra):
    h = batch["x"] @ params["blocks"][0]["w_q"]
    for blk in params["blocks"][1:]:
        h = torch.tanh(h @ blk["w_q"])
    pair = params["pair"]
    out = h @ pair[0] + extra[1] * pair[1]
    return {"loss": F.mse_loss(out, batch["y"]), "aux": [h.mean(), (out.sum(), extra[0].sum())]}


def _tree_args():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(s, generator=g, dtype=torch.float64)  # noqa: E731
    params = {"blocks": [{"w_q": r(4, 6)}, {"w_q": r(6, 6)}, {"w_q": r(6, 6)}, {"w_q": r(6, 6)}],
              "pair": (r(6, 2), r(2))}
    return params, {"x": r(8, 4), "y": r(8, 2)}, [r(8, 3), r(8, 2)]


def test_pytrees_are_preserved_and_leaves_named_by_key_path():
    params, batch, extra = _tree_args()
    graph = ir.trace(_tree_fn, params, batch, extra)
    assert graph.input_names == ("blocks.0.w_q", "blocks.1.w_q", "blocks.2.w_q", "blocks.3.w_q", "pair.0", "pair.1",
                                 "batch.x", "batch.y", "extra.0", "extra.1")
    assert graph.num_params == 6 and len(graph.outputs) == 4
    assert graph.in_tree == pytree.tree_structure((params, batch, extra))
    expected = _tree_fn(params, batch, extra)
    for compiled in (True, False):
        got = ir.evaluate(graph, params, batch, extra, compiled=compiled)
        assert pytree.tree_structure(got) == pytree.tree_structure(expected)
        assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)))


def test_evaluate_rejects_another_structure():
    params, batch, extra = _tree_args()
    graph = ir.trace(_tree_fn, params, batch, extra)
    with pytest.raises(ir.IRError, match="do not match the traced structure"):
        ir.evaluate(graph, params, batch, extra[:1])
    with pytest.raises(ir.IRError, match="takes 10 inputs, got 9"):
        ir.interpret(graph, pytree.tree_leaves((params, batch, extra))[:-1])


def test_trace_needs_no_real_weights():
    """Leaves may be TensorSpecs or meta tensors; evaluating the graph later on real tensors matches eager."""
    params, batch, extra = _tree_args()
    spec = lambda t: ir.TensorSpec(tuple(t.shape), t.dtype)  # noqa: E731
    g_spec = ir.trace(_tree_fn, pytree.tree_map(spec, params), batch, extra)
    g_meta = ir.trace(_tree_fn, pytree.tree_map(lambda t: t.to("meta"), params), batch, extra)
    assert str(g_spec) == str(g_meta) == str(ir.trace(_tree_fn, params, batch, extra))
    assert all(v.aval.device == "cpu" for v in g_meta.defined())
    got = ir.evaluate(g_meta, params, batch, extra)
    assert torch.equal(got["loss"], _tree_fn(params, batch, extra)["loss"])


def test_compile_graph_names_are_python_identifiers():
    """The 45th value prints as `as`, a Python keyword; the generated code must still compile."""
    def many(p, x):
        for w in p:
            x = x * w
        return x.sum()
    params = [torch.full((2,), 1.0 + i / 100, dtype=torch.float64) for i in range(60)]
    x = torch.ones(8, 2, dtype=torch.float64)
    graph = ir.trace(many, params, x)
    assert " as:f64[2]" in str(graph).splitlines()[0]
    assert torch.equal(ir.evaluate(graph, params, x), many(params, x))
