"""Mixed precision: float32 master params, bf16 compute inside the graph, grads through the casts."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import engine
import ir
from engine.errors import PlanError
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.plan import Plan, StagePlan
from engine.planning.search import plan
from engine.precision import mixed_precision
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, head_dim=8)
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.linear.default")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _two_stages(graph: ir.Graph, m: int) -> Plan:
    return Plan("1f1b", 2, 2, 1, m, (len(graph.eqns) // 2,), stages=tuple(StagePlan(k, 0, 0, k) for k in range(2)))


def _setup() -> tuple:
    params, batch = init_params(TINY, torch.float32), example_batch(TINY, 8)
    return make_loss_fn(TINY), params, batch


def test_one_microbatch_pipeline_equals_torch_func_grad_of_the_wrapped_fn_exactly() -> None:
    fn, params, batch = _setup()
    fn16 = mixed_precision(fn)
    graph = ir.trace(fn16, params, *batch)
    result = run_steps(build_steps(fn16, params, batch, _two_stages(graph, 1)), params, batch)
    loss, ref = torch.func.grad_and_value(fn16)(params, *batch)[::-1]
    assert result.loss.dtype == torch.float32 and torch.equal(result.loss, loss)
    for got, want in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(ref)):
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_microbatched_grads_within_bf16_rounding_of_float32() -> None:
    fn, params, batch = _setup()
    fn16 = mixed_precision(fn)
    graph = ir.trace(fn16, params, *[b[:2] for b in batch])
    result = run_steps(build_steps(fn16, params, batch, _two_stages(graph, 4)), params, batch)
    wrapped = torch.func.grad(fn16)(params, *batch)
    fp32_loss, fp32 = torch.func.grad_and_value(fn)(params, *batch)[::-1]
    got, want, ref = (torch.cat([g.flatten() for g in pytree.tree_leaves(t)]) for t in (result.grads, wrapped, fp32))
    assert _rel(got, want) < 2e-2 and _rel(got, ref) < 2e-2, (_rel(got, want), _rel(got, ref))
    assert _rel(want, ref) > 1e-4  # it really computed in bf16 (float32 would agree to ~1e-7)
    assert abs(float(result.loss - fp32_loss)) < 2e-2 * abs(float(fp32_loss))
    for g, r in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(fp32)):
        assert g.dtype == torch.float32 and _rel(g, r) < 5e-2


def test_stages_cast_their_own_params_and_multiply_in_bf16() -> None:
    fn, params, batch = _setup()
    fn16 = mixed_precision(fn)
    p = plan(fn16, params, *batch, world_size=2, microbatches=2, device="cpu")
    graph = ir.trace(fn16, params, *[b[:4] for b in batch])
    assert all(graph.inputs[i].aval.dtype == torch.float32 for i in range(graph.num_params))
    stages = build_steps(fn16, params, batch, p)[0].infos
    for info in stages:
        mms = [e for e in info.ad.forward.graph.eqns if e.op in MATMULS]
        assert mms and all(e.out_vars[0].aval.dtype == torch.bfloat16 for e in mms)
        casts = [e for e in info.ad.forward.graph.eqns if e.op.startswith("aten.to") or e.op.startswith("aten._to_copy")]
        assert len(casts) >= len(info.stage.param_ids) - 1  # each stage casts the params it reads
        for v in info.stage.graph.inputs[info.n_params + info.n_batch:]:  # only activations cross, in bf16
            assert v.aval.shape[0] == 4 and v.aval.dtype == torch.bfloat16, v.aval
    assert sum(len(i.stage.param_ids) for i in stages) < graph.num_params + 2  # only the tied wte is on both


def test_parallelize_compute_dtype_updates_float32_masters() -> None:
    fn, params, batch = _setup()
    step = engine.parallelize(fn, params, *batch, microbatches=1, compute_dtype=torch.bfloat16)
    assert any(e.op in MATMULS and e.out_vars[0].aval.dtype == torch.bfloat16 for e in step.graph.eqns)
    local = step.shard(params)
    loss, grads = step(local, *batch)
    ref_loss, ref = torch.func.grad_and_value(mixed_precision(fn))(params, *batch)[::-1]
    assert torch.equal(loss, ref_loss)
    for got, want in zip(pytree.tree_leaves(grads), pytree.tree_leaves(ref)):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    new, _ = engine.optim.sgd(local, grads, lr=0.1)
    for x, g, p in zip(pytree.tree_leaves(new), pytree.tree_leaves(grads), pytree.tree_leaves(local)):
        assert x.dtype == torch.float32 and torch.allclose(x, p - 0.1 * g, rtol=1e-6, atol=1e-7)  # fp32 master, fp32 grad


def test_module_with_float_inputs_computes_in_bf16() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 5))
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    fn16 = mixed_precision(fn)
    graph = ir.trace(fn16, variables, x, y)
    assert [e.out_vars[0].aval.dtype for e in graph.eqns if e.op in MATMULS] == [torch.bfloat16] * 2
    loss16, loss32 = fn16(variables, x, y), fn(variables, x, y)
    assert loss16.dtype == torch.float32 and 0 < abs(float(loss16 - loss32)) < 2e-2 * float(loss32)


def test_compute_dtype_must_be_a_float_dtype() -> None:
    with pytest.raises(PlanError, match="floating torch.dtype"):
        mixed_precision(lambda p, x: x, torch.int8)
