"""ir.TraceError for functions that are not pure tensor programs; in-place ops on fresh values are fine."""
from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F

import ir

HERE = os.path.basename(__file__)


def _args():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 4, generator=g)}, torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def _trace_error(fn, *args):
    with pytest.raises(ir.TraceError) as info:
        ir.trace(fn, *(args or _args()))
    return str(info.value)


def _line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(src) if text in ln)


def branchy(p, x, y):
    h = x @ p["w"]
    if h.sum() > 0:
        h = h * 2
    return F.mse_loss(h, y)


def test_data_dependent_control_flow_names_the_source_line():
    msg = _trace_error(branchy)
    assert f"{HERE}:{_line_of(branchy, 'if h.sum()')} in branchy: if h.sum() > 0:" in msg
    assert "torch.where" in msg  # the fix


def uses_item(p, x, y):
    scale = x.abs().max().item()
    return F.mse_loss(x @ p["w"] / scale, y)


def test_item_names_the_source_line():
    msg = _trace_error(uses_item)
    assert f"{HERE}:{_line_of(uses_item, '.item()')} in uses_item: scale = x.abs().max().item()" in msg
    assert ".item()" in msg.splitlines()[-1]


def mutates_param(p, x, y):
    p["w"].add_(1)
    return F.mse_loss(x @ p["w"], y)


def mutates_batch(p, x, y):
    x.mul_(2)
    return F.mse_loss(x @ p["w"], y)


def mutates_param_view(p, x, y):
    p["w"][0].zero_()
    return F.mse_loss(x @ p["w"], y)


@pytest.mark.parametrize("fn, name", [(mutates_param, "w"), (mutates_batch, "x"), (mutates_param_view, "w")])
def test_mutating_an_input(fn, name):
    msg = _trace_error(fn)
    assert f"mutates input '{name}'" in msg and "must be pure" in msg


def rng_dropout(p, x, y):
    return F.dropout(x @ p["w"], 0.1)


def rng_randn(p, x, y):
    return F.mse_loss(x @ p["w"] + torch.randn_like(x), y)


def rng_sdpa(p, x, y):
    q = (x @ p["w"]).reshape(8, 1, 1, 4)
    return F.mse_loss(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).reshape(8, 4), y)


@pytest.mark.parametrize("fn, op", [(rng_dropout, "aten.dropout.default"), (rng_randn, "aten.randn"),
                                    (rng_sdpa, "aten.scaled_dot_product_attention.default")])
def test_global_rng_names_the_pure_alternative(fn, op):
    msg = _trace_error(fn)
    assert msg.startswith(op) and "global random state" in msg and "ir.random.dropout(x, p, key)" in msg


def eval_dropout(p, x, y):
    return F.mse_loss(F.dropout(x @ p["w"], 0.5, training=False), y)


def test_eval_mode_dropout_is_the_identity():
    g = ir.trace(eval_dropout, *_args())
    assert [e.op for e in g.eqns] == ["aten.matmul.default", "aten.broadcast_tensors.default", "aten.mse_loss.default"]
    assert torch.equal(ir.evaluate(g, *_args()), eval_dropout(*_args()))


def test_non_tensor_output_and_leaves():
    assert "the function returns 3.0; every output leaf must be a tensor" in _trace_error(lambda p, x, y: 3.0)
    p, x, y = _args()
    msg = _trace_error(lambda p, x, y: F.mse_loss(x @ p["w"], y) * p["lr"], {**p, "lr": 0.1}, x, y)
    assert "leaf 'lr' is a float" in msg and "closing over" in msg


CAPTURED_PARAM = torch.randn(4, 4, requires_grad=True)


def test_capturing_an_outside_tensor_that_needs_grad():
    for outside in (CAPTURED_PARAM, torch.nn.Parameter(torch.randn(4, 4))):
        msg = _trace_error(lambda p, x, y: F.mse_loss(x @ p["w"] @ outside, y))
        assert "captures a tensor from outside" in msg and "pass it in params or the batch" in msg


def test_capturing_a_constant_tensor_bakes_it_in():
    const = torch.tensor([1.0, -2.0, 0.5, 3.0])
    fn = lambda p, x, y: F.mse_loss(x @ p["w"] * const, y)  # noqa: E731
    g = ir.trace(fn, *_args())
    assert sum(isinstance(a, ir.Literal) and isinstance(a.value, torch.Tensor) for e in g.eqns for a in e.args) == 1
    assert torch.equal(ir.evaluate(g, *_args()), fn(*_args()))


def in_place_on_fresh(p, x, y):
    h = x @ p["w"]
    h.relu_()
    h += y
    h.mul_(2)
    h = torch.tanh_(h)
    h -= 1
    return F.mse_loss(h, y)


def test_in_place_ops_on_fresh_values_trace_out_of_place():
    g = ir.trace(in_place_on_fresh, *_args())
    ops = [e.op for e in g.eqns]
    assert ops[:6] == ["aten.matmul.default", "aten.relu.default", "aten.add.Tensor", "aten.mul.Tensor",
                       "aten.tanh.default", "aten.sub.Tensor"]
    assert not any(op.split(".")[1].endswith("_") for op in ops)
    ir.check(g)
    for compiled in (True, False):
        assert torch.equal(ir.evaluate(g, *_args(), compiled=compiled), in_place_on_fresh(*_args()))


def writes_into_a_view(p, x, y):
    h = x @ p["w"]
    h[:, 0] = 0.0
    return F.mse_loss(h, y)


def test_writing_into_a_view_that_is_used_later_names_the_fix():
    msg = _trace_error(writes_into_a_view)
    assert "writes into a tensor whose other views are used later" in msg and "torch.where" in msg
