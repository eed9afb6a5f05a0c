"""Golden strings: graphs print one equation a line (jaxpr style), costs as a table, stage parts as graphs."""
from __future__ import annotations

import textwrap

import torch
import torch.nn.functional as F

import ir
from ir import TensorSpec as S


def _golden(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def mlp(p, x, y):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    return F.mse_loss(h @ p["w2"], y)


def test_mlp_graph():
    g = ir.trace(mlp, {"w1": S((4, 8)), "b1": S((8,)), "w2": S((8, 2))}, S((16, 4)), S((16, 2)))
    assert str(g) == _golden("""
        { lambda a:f32[4,8] b:f32[8] c:f32[8,2] ; d:f32[16,4] e:f32[16,2]. let
            f:f32[16,8] = matmul d a
            g:f32[16,8] = add.Tensor f b
            h:f32[16,8] = tanh g
            i:f32[16,2] = matmul h c
            j:f32[16,2] k:f32[16,2] = broadcast_tensors [i,e]
            l:f32[] = mse_loss j k
          in (l) }
    """)


def multi(p, batch):
    h = batch["x"] @ p["blocks"][0]["w"]
    m, i = h.max(dim=1)
    h2 = h * 2.5 + 1
    return {"loss": (h2 - batch["y"]).square().mean(), "idx": i, "parts": [m.sum(), h.mean()]}


def test_literals_multi_output_ops_and_output_pytrees():
    g = ir.trace(multi, {"blocks": [{"w": S((4, 3))}]}, {"x": S((8, 4)), "y": S((8, 3))})
    assert str(g) == _golden("""
        { lambda a:f32[4,3] ; b:f32[8,4] c:f32[8,3]. let
            d:f32[8,3] = matmul b a
            e:f32[8] f:i64[8] = max.dim d 1
            g:f32[8,3] = mul.Tensor d 2.5
            h:f32[8,3] = add.Tensor g 1
            i:f32[8,3] = sub.Tensor h c
            j:f32[8,3] = square i
            k:f32[] = mean j
            l:f32[] = sum e
            m:f32[] = mean d
          in (k f l m) }
    """)
    assert g.input_names == ("blocks.0.w", "batch.x", "batch.y")


def tokens_fn(p, tokens, y):
    logits = F.embedding(tokens, p["emb"]) @ p["emb"].t()
    return F.cross_entropy(logits.reshape(-1, 5), y.reshape(-1))


def test_int_inputs_and_bf16():
    g = ir.trace(tokens_fn, {"emb": S((5, 4), torch.bfloat16)}, S((8, 2), torch.int64), S((8, 2), torch.int64))
    assert str(g) == _golden("""
        { lambda a:bf16[5,4] ; b:i64[8,2] c:i64[8,2]. let
            d:bf16[8,2,4] = embedding a b
            e:bf16[4,5] = t a
            f:bf16[8,2,5] = matmul d e
            g:bf16[16,5] = reshape f [-1,5]
            h:i64[16] = reshape c [-1]
            i:bf16[] = cross_entropy_loss g h
          in (i) }
    """)


def test_captured_constant_prints_as_const():
    c = torch.tensor([1.0, 2.0, 3.0])
    g = ir.trace(lambda p, x: (x * c + p).sum(), S((3,)), S((8, 3)))
    assert str(g) == _golden("""
        { lambda a:f32[3] ; b:f32[8,3]. let
            c:f32[8,3] = mul.Tensor b constf32[3]
            d:f32[8,3] = add.Tensor c a
            e:f32[] = sum d
          in (e) }
    """)


def big(p, x):
    return torch.relu(x @ p["w"]).sum()


def test_format_costs():
    g = ir.trace(big, {"w": S((1024, 512))}, S((256, 1024)))
    assert ir.format_costs(g).splitlines() == [
        "   #      GFLOP   MB read MB written  equation",
        "   0     0.2684     3.146      0.524  c:f32[256,512] = matmul b a",
        "   1     0.0003     0.524      0.524  d:f32[256,512] = relu c",
        "   2     0.0001     0.524      0.000  e:f32[] = sum d",
        " all     0.2688     4.194      1.049"]
    assert ir.format_costs(g, top=1).splitlines()[1:] == [
        "   0     0.2684     3.146      0.524  c:f32[256,512] = matmul b a",
        " all     0.2688     4.194      1.049"]
    mm = ir.eqn_cost(g.eqns[0])
    assert (mm.flops, mm.bytes_read, mm.bytes_written) == (2 * 256 * 1024 * 512, (256 + 512) * 1024 * 4, 256 * 512 * 4)


def two_layer(p, x, y):
    h = torch.tanh(x @ p["w1"])
    return ((h @ p["w2"] - y) ** 2).mean()


def test_stage_autodiff_parts():
    g = ir.trace(two_layer, {"w1": S((4, 8)), "w2": S((8, 2))}, S((16, 4)), S((16, 2)))
    s0, s1 = ir.split(g, [2])
    assert str(s0.graph) == _golden("""
        { lambda a:f32[4,8] ; b:f32[16,4]. let
            c:f32[16,8] = matmul b a
            d:f32[16,8] = tanh c
          in (d) }
    """)
    assert (s1.param_ids, s1.batch_ids, s1.acts_in, s0.acts_out) == ((1,), (3,), (5,), (5,))
    ad = ir.stage_autodiff(s0.graph, constant=[1])
    assert str(ad.forward.graph) == _golden("""
        { lambda ; a:f32[4,8] b:f32[16,4]. let
            c:f32[16,8] = mm b a
            d:f32[16,8] = tanh c
          in (d) }
    """)
    assert str(ad.backward_input.graph) == "{ lambda ; . let\n  in () }"  # stage 0 has no activation input
    assert str(ad.backward_weight.graph) == _golden("""
        { lambda ; a:f32[16,4] b:f32[16,8] c:f32[16,8]. let
            d:f32[16,8] = tanh_backward b c
            e:f32[4,16] = t a
            f:f32[4,8] = mm e d
          in (f) }
    """)
    assert (ad.backward_weight.in_slots, ad.backward_weight.out_slots) == ((1, 2, 3), (4,))
    assert (ad.out_slots, ad.ct_slots, ad.grad_slots, ad.saved_bytes()) == ((3,), (2,), (4, None), 0)
