"""ir.stage_autodiff: F, B and W split the joint program without recomputation, over consistent slots."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_cases import cut_sets, examples, trace_case

import ir
from ir.autodiff import recomputable
from engine.testing import models
from ir.purify import is_view, resolve


def _views_only(eqns):
    return all(is_view(resolve(e.op)) for e in eqns)


def _stage_ads(case, cuts):
    stages = ir.split(trace_case(case), cuts)
    return [(s, ir.stage_autodiff(s.graph, constant=range(len(s.param_ids), len(s.param_ids) + len(s.batch_ids))))
            for s in stages]


@settings(max_examples=examples(35))
@given(models(max_layers=8), st.data())
def test_parts_share_no_work_and_read_only_slots_written_before_them(case, data):
    n = len(trace_case(case).eqns)
    for stage, ad in _stage_ads(case, data.draw(cut_sets(n), label="cuts")):
        _check_no_recomputation(ad)
        _check_slots(stage, ad)


def _check_no_recomputation(ad):
    """No eqn runs in both B and W; B and W redo only cheap F work (views, pointwise, layer norm)
    whose operands are saved anyway, instead of saving its result."""
    f, b, w = (set(part.graph.eqns) for part in (ad.forward, ad.backward_input, ad.backward_weight))
    assert _views_only(b & w), [e.op for e in b & w]
    redone = (f & b) | (f & w)
    assert all(recomputable(e) for e in redone), [e.op for e in redone if not recomputable(e)]


def _check_slots(stage, ad):
    g = stage.graph
    written = set(range(len(g.inputs))) | {c for c in ad.ct_slots if c is not None}
    for part in (ad.forward, ad.backward_input, ad.backward_weight):
        assert set(part.in_slots) <= written, (part.in_slots, written)
        assert [ad.slot_avals[s] for s in part.in_slots] == [v.aval for v in part.graph.inputs]
        assert [ad.slot_avals[s] for s in part.out_slots] == [v.aval for v in part.graph.outputs]
        written |= set(part.out_slots)
    assert set(ad.out_slots) <= set(ad.forward.out_slots)
    batch = range(g.num_params, g.num_params + len(stage.batch_ids))
    for i, v in enumerate(g.inputs):
        differentiable = v.aval.dtype.is_floating_point and i not in batch
        assert (ad.grad_slots[i] is not None) == differentiable
        if differentiable:
            part = ad.backward_weight if i < g.num_params else ad.backward_input
            assert ad.grad_slots[i] in part.out_slots and ad.slot_avals[ad.grad_slots[i]] == v.aval
    kept = set(ad.forward.out_slots) - set(ad.out_slots)
    assert ad.saved_bytes() == sum(ad.slot_avals[s].nbytes for s in kept)


def test_a_view_of_an_input_is_recomputed_not_saved():
    """B reads the transposed input that attention's backward needs by redoing the (free) transpose."""
    def stage(p, q):
        qt = q.transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(qt, qt, qt).sum()

    g = ir.trace(stage, (), torch.randn(2, 3, 2, 4))
    ad = ir.stage_autodiff(g)
    f_outs = {ad.slot_avals[s].shape for s in ad.forward.out_slots}
    assert (2, 2, 3, 4) in f_outs  # the attention output, which its backward needs
    assert any(e.op == "aten.transpose.int" for e in ad.backward_input.graph.eqns)
    assert ad.backward_input.in_slots[0] == 0  # B reads the stage input itself
    saved = [ad.slot_avals[s] for s in ad.forward.out_slots if s not in ad.out_slots]
    assert sum(a.nbytes for a in saved) == ad.saved_bytes() == 2 * 2 * 3 * 4 * 4 + 2 * 2 * 3 * 4


def test_layer_norm_param_grads_from_b_reach_w():
    """native_layer_norm_backward makes the input grad and the weight/bias grads in one op (in B)."""
    def stage(p, h):
        return torch.nn.functional.layer_norm(h, (4,), p["w"], p["b"]).square().mean()

    p = {"w": torch.randn(4, dtype=torch.float64), "b": torch.randn(4, dtype=torch.float64)}
    h = torch.randn(8, 4, dtype=torch.float64)
    g = ir.trace(stage, p, h)
    ad = ir.stage_autodiff(g)
    assert any("native_layer_norm_backward" in e.op for e in ad.backward_input.graph.eqns)
    slots = dict(enumerate([p["w"], p["b"], h]))
    slots[ad.ct_slots[0]] = torch.ones((), dtype=torch.float64)
    for part in (ad.forward, ad.backward_input, ad.backward_weight):
        slots.update(zip(part.out_slots, ir.compile_graph(part.graph)(*[slots[i] for i in part.in_slots])))
    ref = torch.func.grad(stage, argnums=(0, 1))(p, h)
    assert torch.equal(slots[ad.grad_slots[0]], ref[0]["w"]) and torch.equal(slots[ad.grad_slots[1]], ref[0]["b"])
    assert torch.equal(slots[ad.grad_slots[2]], ref[1])


def test_a_pointwise_result_is_recomputed_from_saved_operands_not_saved():
    """gelu(x @ w1) feeds w2's weight grad: W redoes the gelu from the saved matmul result, so F saves
    one [8, 32] float32 tensor (1024 bytes), not two."""
    def mlp(p, x):
        return (torch.nn.functional.gelu(x @ p["w1"]) @ p["w2"]).sum()

    p = {"w1": torch.randn(16, 32), "w2": torch.randn(32, 4)}
    g = ir.trace(mlp, p, torch.randn(8, 16))
    ad = ir.stage_autodiff(g, constant=[2])
    assert ad.saved_bytes() == 8 * 32 * 4
    assert "aten.gelu.default" in [e.op for e in ad.backward_weight.graph.eqns]
