"""Tracing for a device this machine lacks: attention stays one op, nothing says `meta`, and all but running works."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import ir

ROOT = Path(__file__).resolve().parents[2]

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


PLAN_FOR_CUDA = '''
import json, torch, torch.nn.functional as F
import engine, ir

def loss(p, x, y):                                  # four attention blocks, a factory op on x's device
    b, s, d = x.shape
    heads = lambda t: t.reshape(b, s, 2, d // 2).transpose(1, 2)
    for blk in p["blocks"]:
        q, k, v = (heads(x @ blk[n]) for n in ("w_q", "w_k", "w_v"))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = F.layer_norm(x + a, (d,)) + torch.arange(d, device=x.device) / d
    return F.mse_loss(x, y)

meta = lambda *shape: torch.empty(shape, device="meta")
params = {"blocks": [{n: meta(8, 8) for n in ("w_q", "w_k", "w_v")} for _ in range(4)]}
batch = meta(8, 6, 8), meta(8, 6, 8)
graph = ir.trace(loss, params, *batch, device="cuda")
ir.check(graph)
costs = ir.format_costs(graph)
stages = ir.split(graph, cuts=[len(graph.eqns) // 3, 2 * len(graph.eqns) // 3])
devices, ops = set(), set()
for st in stages:
    for recompute in (False, True):
        ad = ir.stage_autodiff(st.graph, recompute=recompute)
        for part in (ad.forward, ad.backward_input, ad.backward_weight, ad.backward):
            ir.check(part.graph)
            devices |= {v.aval.device for v in part.graph.defined()}
            ops |= {e.op for e in part.graph.eqns}
try:
    ir.evaluate(graph, params, *batch)
    ran = "ran"
except ir.IRError as err:
    ran = str(err)
plan = engine.plan(loss, params, *batch, world_size=4, device="h100", schedule="1f1b")
print(json.dumps({"cuda": torch.cuda.is_available(), "devices": sorted(devices), "costs": costs.splitlines()[-1],
                  "attention": sorted(op for op in ops if "attention" in op), "ran": ran,
                  "plan": [plan.device, len(plan.stages), plan.world_size]}))
'''


def test_a_graph_for_cuda_is_checked_costed_split_differentiated_and_planned_on_a_cpu_only_machine():
    """In a subprocess with no CUDA, so that an abort inside torch (which autograd on a fake cuda tensor
    does on a CPU-only build) fails this test instead of killing pytest."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", PLAN_FOR_CUDA], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["cuda"] is False
    assert got["devices"] == ["cuda:0"]  # every value of every stage program is labelled for the GPU
    assert got["costs"].split()[0] == "all" and float(got["costs"].split()[1]) > 0
    assert got["attention"] == ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                                "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    assert got["ran"].startswith("this graph was traced for cuda, which this machine does not have")
    assert "trace again for this machine" in got["ran"]
    assert got["plan"] == ["h100", 4, 4]
