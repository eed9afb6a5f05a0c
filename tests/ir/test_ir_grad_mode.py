"""Grad-mode regions are stop-gradients: grads equal torch.func.grad's for each construct, at every cut."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ir
from engine.testing import assert_parallel_equivalent


def no_grad(p, x, y):
    with torch.no_grad():
        scale = (x @ p["w"]).sin()  # constant to autodiff, though it reads w
    h = torch.tanh(x @ p["w"]) * scale
    return F.mse_loss(h @ p["v"], y)


@torch.no_grad()
def _rotary(w, x):  # as LlamaRotaryEmbedding.forward: a decorated method
    freqs = (x[..., :2] @ w[:2]).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def decorated(p, x, y):
    cos, sin = _rotary(p["w"], x)
    h = x @ p["w"]
    h = h * cos[..., :4] + torch.roll(h, 1, -1) * sin[..., :4]
    return F.mse_loss(h @ p["v"], y)


def enable_grad_inside(p, x, y):
    with torch.no_grad():
        a = x @ p["w"]
        with torch.enable_grad():
            b = torch.tanh(a * p["w"][0])  # differentiable in w[0], not through a
        c = b * a  # constant again
    return F.mse_loss((b + c) @ p["v"], y)


def set_grad_enabled(p, x, y):
    with torch.set_grad_enabled(False):
        a = torch.relu(x @ p["w"])
    h = a * (x @ p["w"])
    torch.set_grad_enabled(False)  # the function form, switched back
    m = h.abs().amax(-1, keepdim=True)
    torch.set_grad_enabled(True)
    return F.mse_loss((h / m) @ p["v"], y)


def inference_mode(p, x, y):
    with torch.inference_mode():
        scale = torch.sigmoid(p["w"].sum(0))
    h = (x @ p["w"]) * scale.clone()
    return F.mse_loss(h @ p["v"], y)


def returns_a_no_grad_value(p, x, y):
    with torch.no_grad():
        t = x @ p["w"]
    return F.mse_loss((x @ p["w"]) @ p["v"], y) + (t @ p["v"]).mean()


CASES = [no_grad, decorated, enable_grad_inside, set_grad_enabled, inference_mode, returns_a_no_grad_value]


def _args():
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(4, 4, generator=g, dtype=torch.float64), "v": torch.randn(4, 3, generator=g, dtype=torch.float64)}
    return p, torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__)
def test_grads_equal_torch_func_grad_at_every_two_stage_cut(fn):
    p, x, y = _args()
    g = ir.trace(fn, p, x, y)
    assert torch.allclose(ir.evaluate(g, p, x, y), fn(p, x, y), rtol=1e-12, atol=0)
    assert "aten.detach.default" in [e.op for e in g.eqns]
    for cut in range(1, len(g.eqns)):
        assert_parallel_equivalent(fn, p, x, y, stages=2, cuts=[cut], microbatches=2)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_split_backward_schedules(schedule):
    p, x, y = _args()
    assert_parallel_equivalent(decorated, p, x, y, schedule=schedule, stages=4)


def test_the_stop_gradient_changes_the_grads():
    """Guards the test above against a region that was ignored: without no_grad the grads differ."""
    p, x, y = _args()

    def without(p, x, y):
        scale = (x @ p["w"]).sin()
        return F.mse_loss((torch.tanh(x @ p["w"]) * scale) @ p["v"], y)

    assert not torch.allclose(torch.func.grad(without)(p, x, y)["w"], torch.func.grad(no_grad)(p, x, y)["w"])


def test_only_values_read_with_grad_on_are_detached():
    p, x, y = _args()
    g = ir.trace(enable_grad_inside, p, x, y)
    detached = [e for e in g.eqns if e.op == "aten.detach.default"]
    assert len(detached) == 2  # a (read by the enable_grad region) and c (read by the loss); not b
