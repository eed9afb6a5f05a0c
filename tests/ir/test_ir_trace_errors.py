"""ir.TraceError: one message per cause, with that cause's fix only; in-place ops on fresh values are fine."""
from __future__ import annotations

import importlib
import inspect
import os
import sys

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
    assert msg.startswith("cannot trace branchy: Python reads a tensor's value (aten._local_scalar_dense.default)")
    assert f"{HERE}:{_line_of(branchy, 'if h.sum()')} in branchy: if h.sum() > 0:" in msg
    assert msg.splitlines()[-1].startswith("Fix: keep the choice in tensor ops (torch.where(cond, a, b)")


def uses_item(p, x, y):
    scale = x.abs().max().item()
    return F.mse_loss(x @ p["w"] / scale, y)


def uses_tolist(p, x, y):
    return F.mse_loss(x @ p["w"] * x[0, 0].tolist(), y)


def asserts_on_values(p, x, y):
    assert torch.isfinite(x).all()
    return F.mse_loss(x @ p["w"], y)


@pytest.mark.parametrize("fn, text", [(uses_item, "scale = x.abs().max().item()"),
                                      (uses_tolist, 'return F.mse_loss(x @ p["w"] * x[0, 0].tolist(), y)'),
                                      (asserts_on_values, "assert torch.isfinite(x).all()")])
def test_reading_values_names_the_source_line(fn, text):
    msg = _trace_error(fn)
    assert f"{HERE}:{_line_of(fn, text)} in {fn.__name__}: {text}" in msg
    assert ".item()" in msg.splitlines()[-1] and "torch.where" in msg.splitlines()[-1]


def boolean_mask(p, x, y):
    h = x @ p["w"]
    return h[h > 0].mean()


def uses_unique(p, x, y):
    return torch.unique(x @ p["w"]).float().mean()


@pytest.mark.parametrize("fn, op, text", [(boolean_mask, "aten.nonzero.default", "return h[h > 0].mean()"),
                                          (uses_unique, "aten._unique2.default", "torch.unique(x @ p")])
def test_data_dependent_shapes_say_so_and_how_to_keep_shapes_fixed(fn, op, text):
    msg = _trace_error(fn)
    assert msg.startswith(f"cannot trace {fn.__name__}: {op} makes a tensor whose shape depends on the data")
    assert f"{HERE}:{_line_of(fn, text)} in {fn.__name__}:" in msg
    assert msg.splitlines()[-1].startswith("Fix: keep shapes fixed: weight by the mask instead of selecting")
    assert "torch.where(cond" not in msg and "global random" not in msg


def shape_bug(p, x, y):
    return F.mse_loss(x @ p["w"] @ torch.ones(3, 3), y)


def test_an_error_in_the_function_itself_is_named_as_such():
    msg = _trace_error(shape_bug)
    assert msg.startswith("cannot trace shape_bug: it raised RuntimeError: a and b must have same reduction dim")
    assert f"{HERE}:{_line_of(shape_bug, 'torch.ones(3, 3)')} in shape_bug:" in msg
    assert "error in the function itself" in msg and "tensor's value" not in msg and "torch.where" not in msg


def test_a_module_is_not_a_function():
    msg = _trace_error(torch.nn.Linear(4, 4))
    assert msg.startswith("ir.trace takes a pure function fn(params, *batch) -> loss and its params, not an "
                          "nn.Module (Linear)")
    assert "fn, variables = engine.functionalize(model, loss=F.cross_entropy)" in msg


def mutates_param(p, x, y):
    p["w"].add_(1)
    return F.mse_loss(x @ p["w"], y)


def mutates_batch(p, x, y):
    x.mul_(2)
    return F.mse_loss(x @ p["w"], y)


def mutates_param_view(p, x, y):
    p["w"][0].zero_()
    return F.mse_loss(x @ p["w"], y)


@pytest.mark.parametrize("fn, name, text", [(mutates_param, "w", 'p["w"].add_(1)'), (mutates_batch, "x", "x.mul_(2)"),
                                           (mutates_param_view, "w", 'p["w"][0].zero_()')])
def test_mutating_an_input(fn, name, text):
    msg = _trace_error(fn)
    assert msg.splitlines()[0].endswith(f"mutates input '{name}' in place")
    assert msg.splitlines()[1].endswith(f"{HERE}:{_line_of(fn, text)} in {fn.__name__}: {text}")
    assert "must be pure" in msg and msg.splitlines()[-1].startswith("Fix: compute a new tensor")
    assert "random" not in msg and "torch.where(cond" not in msg


def rng_dropout(p, x, y):
    return F.dropout(x @ p["w"], 0.1)


def rng_randn(p, x, y):
    return F.mse_loss(x @ p["w"] + torch.randn_like(x), y)


def rng_sdpa(p, x, y):
    q = (x @ p["w"]).reshape(8, 1, 1, 4)
    return F.mse_loss(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5).reshape(8, 4), y)


def drop_path(x, drop_prob=0.1):  # timm.layers.drop_path, as written there
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    random_tensor.div_(keep_prob)
    return x * random_tensor


class DropPath(torch.nn.Module):
    def forward(self, x):
        return drop_path(x, 0.1)


def rng_drop_path(p, x, y):
    return F.mse_loss(DropPath()(x @ p["w"]), y)


def rng_rand_mask(p, x, y):
    h = x @ p["w"]
    return F.mse_loss(h * (torch.rand(h.shape[0], 1) > 0.1), y)


@pytest.mark.parametrize("fn, op, text", [
    (rng_dropout, "aten.dropout.default", "F.dropout(x @ p"), (rng_randn, "aten.randn", "torch.randn_like(x)"),
    (rng_sdpa, "aten.scaled_dot_product_attention.default", "dropout_p=0.5"),
    (rng_drop_path, "aten.bernoulli_.float", "random_tensor = x.new_empty(shape).bernoulli_(keep_prob)"),
    (rng_rand_mask, "aten.rand.default", "torch.rand(h.shape[0], 1)")])
def test_global_rng_names_the_pure_alternative(fn, op, text):
    """DropPath's `new_empty(...).bernoulli_(p)` is refused for its RNG, not as an in-place op."""
    msg = _trace_error(fn)
    assert msg.startswith(op) and "global random state" in msg and "ir.keyed_dropout(keys)" in msg and "ir.random.uniform(key, shape)" in msg
    assert f"{HERE}:{_line_of(drop_path if fn is rng_drop_path else fn, text)}" in msg.splitlines()[1]
    assert "in-place" not in msg and "torch.where(cond" not in msg and "drop_path_rate=0" in msg


def test_rng_in_a_library_names_its_line_and_the_callers(tmp_path, monkeypatch):
    """timm's DropPath in train mode: the library's line, then the line of the loss that called it."""
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "droplib.py").write_text("import torch\n" + inspect.getsource(drop_path) + "\n\n" + inspect.getsource(DropPath))
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.delitem(sys.modules, "droplib", raising=False)
    droplib = importlib.import_module("droplib")
    block = droplib.DropPath()

    def loss(p, x, y):
        return F.mse_loss(block(x @ p["w"]), y)

    lines = _trace_error(loss).splitlines()
    assert lines[1] == f"  at {lib / 'droplib.py'}:5 in drop_path: random_tensor = x.new_empty(shape).bernoulli_(keep_prob)"
    assert lines[2] == f"  called from {__file__}:{_line_of(loss, 'block(x')} in loss: return F.mse_loss(block(x @ p[\"w\"]), y)"


def test_every_cause_has_its_own_fix():
    fixes = {_trace_error(fn).splitlines()[-1] for fn in (branchy, boolean_mask, shape_bug, mutates_param, rng_drop_path)}
    assert len(fixes) == 5 and all(f.startswith("Fix: ") for f in fixes)


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


def test_writing_into_a_view_of_a_fresh_tensor_is_functionalized():
    g = ir.trace(writes_into_a_view, *_args())
    assert not any(e.op.split(".")[1].endswith("_") for e in g.eqns)
    assert "aten.select_scatter.default" in [e.op for e in g.eqns]
    for compiled in (True, False):
        assert torch.equal(ir.evaluate(g, *_args(), compiled=compiled), writes_into_a_view(*_args()))
