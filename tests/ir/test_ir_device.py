"""Tracing for a device this machine lacks: attention stays one fused-able op, and nothing says `meta`."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import ir


def attention_block(p, batch):
    x, key = batch["x"], batch["key"]
    b, s, d = x.shape
    heads = lambda t: t.reshape(b, s, 2, d // 2).transpose(1, 2)  # noqa: E731
    q, k, v = (heads(x @ p["blocks"][0][n]) for n in ("w_q", "w_k", "w_v"))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
    a = ir.random.dropout(a, 0.1, key)
    h = F.layer_norm(x + a, (d,)) + torch.zeros_like(x) + torch.arange(d, device=x.device)
    return {"loss": F.mse_loss(h, batch["y"]), "extra": (h.mean(),)}


def _inputs(leaf):
    params = {"blocks": [{n: leaf((8, 8), torch.float32) for n in ("w_q", "w_k", "w_v")}]}
    batch = {"x": leaf((4, 6, 8), torch.float32), "y": leaf((4, 6, 8), torch.float32),
             "key": leaf((), torch.int64)}
    return params, batch


def _no_meta(graph):
    for e in graph.eqns:
        text = f"{e.args!r} {e.kwargs!r}"
        assert "meta" not in text, (e.op, text)
    assert all(v.aval.device != "meta" for v in graph.defined())


def test_cuda_trace_on_a_cpu_machine_keeps_one_attention_op():
    meta = lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    graph = ir.trace(attention_block, *_inputs(meta), device="cuda")
    ops = [e.op for e in graph.eqns]
    assert ops.count("aten.scaled_dot_product_attention.default") == 1
    assert not {"aten.bmm.default", "aten._softmax.default", "aten.softmax.int"} & set(ops)
    assert all(v.aval.device.startswith("cuda") for v in graph.defined())
    _no_meta(graph)
    factory = [dict(e.kwargs).get("device") for e in graph.eqns if "device" in dict(e.kwargs)]
    assert factory and all(str(d).startswith("cuda") for d in factory)
    assert graph.input_names == ("blocks.0.w_q", "blocks.0.w_k", "blocks.0.w_v", "batch.x", "batch.y", "batch.key")


def test_meta_and_spec_leaves_trace_for_cpu_and_evaluate_like_eager():
    spec = lambda shape, dtype: ir.TensorSpec(shape, dtype)  # noqa: E731
    graph = ir.trace(attention_block, *_inputs(spec))
    _no_meta(graph)
    gen = torch.Generator().manual_seed(0)
    real = lambda shape, dtype: (torch.randn(shape, generator=gen) if dtype.is_floating_point  # noqa: E731
                                 else torch.tensor(7))
    params, batch = _inputs(real)
    expected = attention_block(params, batch)
    got = ir.evaluate(graph, params, batch)
    assert pytree.tree_structure(got) == pytree.tree_structure(expected)
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)))
