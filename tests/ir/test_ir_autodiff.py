"""ir.stage_autodiff: F, B and W split the joint program without recomputation, over consistent slots."""
from __future__ import annotations

import pytest
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


def _stage_ads(case, cuts, level=False):
    stages = ir.split(trace_case(case), cuts)
    return [(s, ir.stage_autodiff(s.graph, constant=range(len(s.param_ids), len(s.param_ids) + len(s.batch_ids)),
                                  recompute=level)) for s in stages]


@settings(max_examples=examples(35))
@given(models(max_layers=8), st.data())
def test_parts_share_no_work_and_read_only_slots_written_before_them(case, data):
    n = len(trace_case(case).eqns)
    level = data.draw(st.sampled_from([False, "cheap"]), label="recompute")
    for stage, ad in _stage_ads(case, data.draw(cut_sets(n), label="cuts"), level):
        _check_no_recomputation(ad, views_only=level is False)
        _check_slots(stage, ad)


def _check_no_recomputation(ad, views_only=False):
    """No eqn runs in both B and W; B and W redo only cheap F work (views, pointwise, layer norm)
    whose operands are saved anyway, instead of saving its result; with `views_only` (recompute=False)
    only views."""
    f, b, w = (set(part.graph.eqns) for part in (ad.forward, ad.backward_input, ad.backward_weight))
    assert _views_only(b & w), [e.op for e in b & w]
    redone = (f & b) | (f & w)
    assert all(recomputable(e) for e in redone), [e.op for e in redone if not recomputable(e)]
    assert not views_only or _views_only(redone), [e.op for e in redone]
    assert set(ad.backward.graph.eqns) == b | w  # BW fused: the same work, once


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
    assert ad.saved_bytes() == _held_bytes(ad, kept) <= sum(ad.slot_avals[s].nbytes for s in kept)


def _held_bytes(ad, slots):
    """The bytes F's outputs in `slots` hold when F runs on real tensors: each storage F made once, an output on an
    input's storage at its own size (as `StageAD.slot_bytes` counts them)."""
    gen = torch.Generator().manual_seed(0)
    args = [torch.rand(v.aval.shape, generator=gen, dtype=v.aval.dtype) if v.aval.dtype.is_floating_point
            else torch.zeros(v.aval.shape, dtype=v.aval.dtype) for v in ad.forward.graph.inputs]
    outs = dict(zip(ad.forward.out_slots, ir.interpret(ad.forward.graph, args)))
    inputs = {a.untyped_storage().data_ptr() for a in args if a.numel()}
    made: dict[int, int] = {}
    total = 0
    for s in slots:
        storage = outs[s].untyped_storage()
        if not outs[s].numel() or storage.data_ptr() in inputs:
            total += ad.slot_avals[s].nbytes
        else:
            made[storage.data_ptr()] = storage.nbytes()
    return total + sum(made.values())


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
    ad = ir.stage_autodiff(g, constant=[2], recompute="cheap")
    assert ad.saved_bytes() == 8 * 32 * 4
    assert "aten.gelu.default" in [e.op for e in ad.backward_weight.graph.eqns]


def test_without_recomputation_the_backward_runs_no_forward_kernel():
    """recompute=False (the default): F saves the gelu's result too (two [8, 32] float32 tensors), and
    neither B nor W redoes any forward equation but views (eager autograd's kernels exactly); the grads
    equal those of the "cheap" level."""
    def mlp(p, x):
        return (torch.nn.functional.gelu(x @ p["w1"]) @ p["w2"]).sum()

    gen = torch.Generator().manual_seed(0)
    p = {"w1": torch.randn(16, 32, generator=gen, dtype=torch.float64),
         "w2": torch.randn(32, 4, generator=gen, dtype=torch.float64)}
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
    g = ir.trace(mlp, p, x)
    plain, cheap = ir.stage_autodiff(g, constant=[2]), ir.stage_autodiff(g, constant=[2], recompute="cheap")
    assert plain.saved_bytes() == 2 * 8 * 32 * 8 > cheap.saved_bytes() == 8 * 32 * 8
    forward = set(plain.forward.graph.eqns)
    assert _views_only([e for e in plain.backward.graph.eqns if e in forward])
    assert any(e.op == "aten.gelu.default" for e in cheap.backward.graph.eqns)
    for ad in (plain, cheap):
        slots = dict(enumerate([p["w1"], p["w2"], x]))
        slots[ad.ct_slots[0]] = torch.ones((), dtype=torch.float64)
        run = ir.compile_graph(ad.forward.graph)(*[slots[i] for i in ad.forward.in_slots])
        slots.update(zip(ad.forward.out_slots, run))
        slots.update(zip(ad.backward.out_slots, ir.compile_graph(ad.backward.graph)(*[slots[i] for i in ad.backward.in_slots])))
        ref = torch.func.grad(mlp)(p, x)
        torch.testing.assert_close(slots[ad.grad_slots[0]], ref["w1"], rtol=1e-12, atol=0)
        torch.testing.assert_close(slots[ad.grad_slots[1]], ref["w2"], rtol=1e-12, atol=0)


def test_an_unknown_recompute_level_is_refused():
    g = ir.trace(lambda p, x: (p * x).sum(), torch.ones(3), torch.ones(3))
    with pytest.raises(ir.IRError, match="recompute must be False .*'cheap'.*or True .*got 'some'"):
        ir.stage_autodiff(g, recompute="some")


def test_a_chain_of_cheap_ops_is_recomputed_from_a_saved_operand():
    """As in a transformer MLP, W reads `view(gelu(fc))` for the second weight's grad: the view and the
    gelu are both redone from `fc` (which gelu's backward keeps), so F saves one [2, 8, 32] tensor."""
    def mlp(p, x):
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, p["w1"]), approximate="tanh")
        return torch.nn.functional.linear(h, p["w2"]).sum()

    p = {"w1": torch.randn(32, 16), "w2": torch.randn(4, 32)}
    x = torch.randn(2, 8, 16, requires_grad=True)
    ad = ir.stage_autodiff(ir.trace(mlp, p, x), recompute="cheap")
    assert ad.saved_bytes() == 2 * 8 * 32 * 4
    assert "aten.gelu.default" in [e.op for e in ad.backward_weight.graph.eqns]


def test_the_fused_backward_does_b_and_w_work_once_and_matches_them():
    """`backward` (BW) holds exactly B's and W's equations, reads only what F and the cotangents give,
    and computes the same input and weight grads."""
    def block(p, h):
        h = torch.nn.functional.layer_norm(h, (8,), p["ln"], None)
        return torch.tanh(torch.nn.functional.gelu(h @ p["w1"]) @ p["w2"]).square().mean()

    gen = torch.Generator().manual_seed(0)
    p = {"ln": torch.rand(8, generator=gen, dtype=torch.float64) + 0.5,
         "w1": torch.randn(8, 16, generator=gen, dtype=torch.float64),
         "w2": torch.randn(16, 8, generator=gen, dtype=torch.float64)}
    h = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    ad = ir.stage_autodiff(ir.trace(block, p, h))
    parts = (ad.backward_input, ad.backward_weight)
    assert set(ad.backward.graph.eqns) == set(parts[0].graph.eqns) | set(parts[1].graph.eqns)
    assert set(ad.backward.in_slots) <= set(range(4)) | set(ad.forward.out_slots) | {ad.ct_slots[0]}
    slots = dict(enumerate([p["ln"], p["w1"], p["w2"], h]))
    slots[ad.ct_slots[0]] = torch.ones((), dtype=torch.float64)
    slots.update(zip(ad.forward.out_slots, ir.compile_graph(ad.forward.graph)(*[slots[i] for i in ad.forward.in_slots])))
    fused = dict(zip(ad.backward.out_slots, ir.compile_graph(ad.backward.graph)(*[slots[i] for i in ad.backward.in_slots])))
    for part in parts:
        slots.update(zip(part.out_slots, ir.compile_graph(part.graph)(*[slots[i] for i in part.in_slots])))
    ref = torch.func.grad(block, argnums=(0, 1))(p, h)
    for i, want in enumerate([ref[0]["ln"], ref[0]["w1"], ref[0]["w2"], ref[1]]):
        torch.testing.assert_close(fused[ad.grad_slots[i]], want, rtol=1e-12, atol=0)
        torch.testing.assert_close(slots[ad.grad_slots[i]], want, rtol=1e-12, atol=0)


def test_compiled_outputs_can_be_accumulated_in_place():
    """`compile_graph(g, accumulate=...)`: those outputs are added into trailing accumulator arguments
    (and returned as None); the others come back as usual."""
    def f(a, b):
        return a * b, a + b, (a - b).sum()

    a, b = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    g = ir.trace(f, a, b)
    acc0, acc2 = torch.ones(3, dtype=torch.float64), torch.full((), 2.0, dtype=torch.float64)
    out = ir.compile_graph(g, (0, 2))(a, b, acc0, acc2)
    assert out[0] is None and out[2] is None and torch.equal(out[1], a + b)
    assert torch.equal(acc0, 1 + a * b) and torch.equal(acc2, 2 + (a - b).sum())
    assert ir.compile_graph(g)(a, b)[0] is not None  # the plain variant is cached apart


def test_recomputed_work_runs_where_it_is_first_needed():
    """In a backward, each recomputed forward equation sits just before its first reader (with only other
    recomputed equations between), so the backward holds one layer's recomputed activations at a time,
    not every layer's: for 6 layers its peak is under two layers' worth of gelu outputs plus the grads."""
    def mlp(p, x):
        for layer in p:
            x = x + torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, layer[0])),
                                               layer[1])
        return x.sum()

    d, f, n = 16, 256, 6
    p = [(torch.randn(f, d), torch.randn(d, f)) for _ in range(n)]
    x = torch.randn(64, d, requires_grad=True)
    ad = ir.stage_autodiff(ir.trace(mlp, p, x), recompute="cheap")
    forward = set(ad.forward.graph.eqns)
    for part in (ad.backward, ad.backward_weight):
        eqns = part.graph.eqns
        redone = [i for i, e in enumerate(eqns) if e in forward]
        assert sum(eqns[i].op == "aten.gelu.default" for i in redone) == n
        for i in redone:
            outs = set(eqns[i].out_vars)
            first = next(j for j in range(i + 1, len(eqns)) if outs & set(eqns[j].inputs))
            assert all(eqns[k] in forward for k in range(i + 1, first)), (i, first)
    gelu_out = 64 * f * 4
    grads = sum(w.numel() * 4 for layer in p for w in layer)
    assert ir.run_bytes(ad.backward.graph).peak < 2 * gelu_out + grads + 2 * 64 * f * 4


def test_a_joint_cache_traces_each_stage_once_and_changes_no_program():
    """`joints` (the planner's cache): every recompute level of one stage reads the same traced joint, and
    each level's F/B/W/BW programs print exactly as without the cache."""
    def mlp(p, x):
        return (torch.nn.functional.gelu(x @ p["w1"]) @ p["w2"]).sum()

    g = ir.trace(mlp, {"w1": torch.randn(16, 32), "w2": torch.randn(32, 4)}, torch.randn(8, 16))
    joints: dict = {}
    for level in (False, "cheap", True):
        cached = ir.stage_autodiff(g, constant=[2], recompute=level, joints=joints)
        fresh = ir.stage_autodiff(g, constant=[2], recompute=level)
        assert len(joints) == 1
        for part in ("forward", "backward_input", "backward_weight", "backward"):
            a, b = getattr(cached, part), getattr(fresh, part)
            assert str(a.graph) == str(b.graph) and (a.in_slots, a.out_slots) == (b.in_slots, b.out_slots)
        assert (cached.grad_slots, cached.ct_slots, cached.num_slots) == (fresh.grad_slots, fresh.ct_slots,
                                                                          fresh.num_slots)
