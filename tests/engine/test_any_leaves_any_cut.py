"""Integer and bool leaves anywhere, and stages with nothing to differentiate, under every schedule.

Only floating leaves are differentiated; integer and bool ones (position ids, masks, integer buffers)
get None grads, in the pipelined step and in the harness's reference. A stage whose inputs are all
integer, that has no input at all, or whose float outputs do not depend on its inputs (BERT's attention
mask, an arange) runs under every schedule: its backward hands on zeros.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import ir
from engine.execution.inprocess import run_steps
from engine.testing import assert_parallel_equivalent
from engine.testing.harness import inprocess_steps, reference_grad_and_value

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv")


def int_leaves(p, x, mask, y):
    h = torch.tanh(x @ p["w"]) + p["pos_table"][p["pos_ids"]]
    h = h * mask.unsqueeze(-1).to(h.dtype)
    h = torch.where(p["flag"], h, -h)
    return F.mse_loss(h @ p["v"], y)


def _int_case():
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(4, 4, generator=g, dtype=torch.float64), "pos_ids": torch.tensor([2, 0, 1, 3]),
         "pos_table": torch.randn(5, 4, generator=g, dtype=torch.float64), "flag": torch.tensor(True),
         "v": torch.randn(4, 2, generator=g, dtype=torch.float64)}
    x = torch.randn(8, 4, 4, generator=g, dtype=torch.float64)
    return p, x, torch.rand(8, 4, generator=g) > 0.3, torch.randn(8, 4, 2, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 4])
def test_integer_and_bool_leaves_in_params_and_batch(schedule, stages):
    p, *batch = _int_case()
    result = assert_parallel_equivalent(int_leaves, p, *batch, schedule=schedule, stages=stages)
    assert result.leaves == 3 and result.max_rel_error < 1e-10  # the three float leaves, compared


def test_integer_leaves_get_none_grads_in_the_step_and_the_reference():
    p, *batch = _int_case()
    grads, loss = reference_grad_and_value(int_leaves, p, batch)
    assert grads["pos_ids"] is None and grads["flag"] is None
    expected = torch.func.grad(lambda w: int_leaves({**p, "w": w}, *batch))(p["w"])
    assert torch.equal(grads["w"], expected) and torch.equal(loss, int_leaves(p, *batch))
    from engine.testing import PlanSpec

    plan = PlanSpec("1f1b", 2, 2).to_plan(int_leaves, p, *batch)
    result = run_steps(inprocess_steps(int_leaves, p, batch, plan), p, batch)
    assert result.grads["pos_ids"] is None and result.grads["flag"] is None
    assert torch.allclose(result.grads["w"], expected, rtol=1e-10, atol=0)


def nothing_to_differentiate(p, ids, y):
    pos = ids + 1  # a stage of integer ops only: its outputs have no cotangent
    pos = pos * 1
    c = torch.arange(4, dtype=torch.float64, device=ids.device)  # a stage with no input at all
    c = c * 0.5
    h = p["emb"][pos]
    h = torch.tanh(h @ p["w"]) + c
    return F.mse_loss(h.sum(-1), y)


def from_the_batch_only(p, ids, mask, y):
    m = (1.0 - mask.to(torch.float64)) * -1e4  # float, but a function of the batch: BERT's extended mask
    h = p["emb"][ids]
    h = torch.tanh(h @ p["w"]) + m.unsqueeze(-1)
    return F.mse_loss(h.sum(-1), y)


def _cut_case(fn):
    g = torch.Generator().manual_seed(1)
    p = {"emb": torch.randn(10, 4, generator=g, dtype=torch.float64),
         "w": torch.randn(4, 4, generator=g, dtype=torch.float64)}
    ids = torch.randint(0, 8, (8, 3), generator=g)
    y = torch.randn(8, 3, generator=g, dtype=torch.float64)
    if fn is from_the_batch_only:
        return p, ids, torch.rand(8, 3, generator=g) > 0.3, y
    return p, ids, y


@pytest.mark.parametrize("fn", [nothing_to_differentiate, from_the_batch_only])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_cut_of_stages_with_nothing_to_differentiate(fn, schedule):
    p, *batch = _cut_case(fn)
    n = len(ir.trace(fn, p, *batch).eqns)
    for cuts in ([1, 2, 3], [2, 3, 4], [1, 3, 5], [n - 3, n - 2, n - 1]):
        result = assert_parallel_equivalent(fn, p, *batch, schedule=schedule, stages=4, cuts=cuts)
        assert result.leaves == 2 and result.max_rel_error < 1e-10


def test_a_stage_without_differentiable_inputs_has_zero_input_grads_and_runs():
    p, *batch = _cut_case(nothing_to_differentiate)
    g = ir.trace(nothing_to_differentiate, p, *batch)
    first = ir.split(g, [2])[0].graph  # integer ops only
    ad = ir.stage_autodiff(first, constant=range(first.num_params, len(first.inputs)))
    assert all(s is None for s in ad.grad_slots) and all(s is None for s in ad.ct_slots)
    flat = pytree.tree_leaves((p, *batch))
    outs = ir.compile_graph(ad.forward.graph)(*[flat[g.inputs.index(v)] for v in first.inputs])
    assert torch.equal(outs[0], (batch[0] + 1) * 1)
