"""has_aux: `step(...)` returns `((loss, aux), grads)` equal to `torch.func.grad_and_value(has_aux=True)`, aux on every rank."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import engine
from engine.execution.inprocess import build_steps, run_steps

RTOL = 1e-12  # float64


def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    h1 = torch.tanh(x @ p["w1"])
    first = h1.mean()  # computed on stage 0 when cut after it: carried to the last stage like an activation
    h = torch.tanh(h1 @ p["w2"])
    out = h @ p["w3"]
    aux = {"first": first, "mae": (out - y).abs().mean(), "cols": [h.mean(0), (out > 0).double().mean()]}
    return F.mse_loss(out, y), aux


def model(dtype: torch.dtype = torch.float64) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype) / s[0] ** 0.5  # noqa: E731
    return {"w1": r(6, 8), "w2": r(8, 8), "w3": r(8, 1)}, r(16, 6), r(16, 1)


def assert_close(got: Any, want: Any) -> None:
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a, b)
        assert torch.allclose(a, b, rtol=RTOL, atol=1e-14), (a, b)


def test_one_process_returns_loss_aux_and_grads_like_torch_func() -> None:
    params, x, y = model()
    grads, (loss, aux) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, x, y)
    step = engine.parallelize(loss_fn, params, x, y, microbatches=4, has_aux=True)
    (got_loss, got_aux), got_grads = step(step.shard(params), x, y)
    assert pytree.tree_structure(got_aux) == pytree.tree_structure(aux)
    assert_close((got_loss, got_aux, got_grads), (loss, aux, grads))


@pytest.mark.parametrize("schedule,world,stages,dp,cuts", [
    ("1f1b", 2, 2, 1, [3]),       # `first` made on stage 0 and carried; the other aux on stage 1
    ("gpipe", 2, 2, 1, None),
    ("zbv", 2, 4, 1, None),       # the last stage sits on rank 0
    ("1f1b", 4, 2, 2, [3]),       # two replicas: each adds its half, every rank gets the sum
])
def test_every_rank_gets_the_full_batch_aux(schedule: str, world: int, stages: int, dp: int, cuts: Any) -> None:
    params, x, y = model()
    grads, (loss, aux) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, x, y)
    plan = engine.plan(loss_fn, params, x, y, world_size=world, schedule=schedule, stages=stages, dp=dp,
                       microbatches=4, cuts=cuts, has_aux=True)
    steps = build_steps(loss_fn, params, (x, y), plan, has_aux=True)
    result = run_steps(steps, params, (x, y))
    for (got_loss, got_aux), _ in result.per_rank:
        assert_close((got_loss, got_aux), (loss, aux))
    assert_close(result.grads, grads)
    if cuts == [3]:  # the aux `first` is computed on stage 0: it really crosses a stage boundary
        graph, stage0 = steps[0].graph, steps[0].infos[0].stage
        first = graph.eqns[2]
        assert first.op == "aten.mean.default" and first.out_vars[0] is graph.outputs[1]
        assert list(graph.defined()).index(first.out_vars[0]) in stage0.acts_out


def test_aux_averages_over_microbatches_like_the_loss() -> None:
    """The documented semantics: each aux leaf is the mean of its per-microbatch values (for a mean over the
    batch that is the full-batch value; a per-example value is averaged elementwise, not concatenated)."""
    params, x, y = model()

    def per_example(p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.tanh(x @ p["w1"]) @ p["w2"] @ p["w3"]
        return F.mse_loss(out, y), out[:, 0]

    step = engine.parallelize(per_example, params, x, y, microbatches=4, has_aux=True)
    (_, aux), _ = step(step.shard(params), x, y)
    full = per_example(params, x, y)[1]
    assert aux.shape == (4,) and torch.allclose(aux, full.reshape(4, 4).mean(0), rtol=RTOL)


def test_mixed_precision_has_aux_returns_a_float32_loss() -> None:
    params, x, y = model(torch.float32)
    step = engine.parallelize(loss_fn, params, x, y, microbatches=2, has_aux=True, compute_dtype=torch.bfloat16)
    (loss, aux), grads = step(step.shard(params), x, y)
    ref_grads, (ref_loss, _) = torch.func.grad_and_value(engine.mixed_precision(loss_fn, torch.bfloat16),
                                                         has_aux=True)(params, x, y)
    assert loss.dtype == torch.float32 and float(loss) == pytest.approx(float(ref_loss), rel=1e-2)
    assert set(aux) == {"first", "mae", "cols"} and grads["w1"].dtype == torch.float32


def test_the_plan_cache_keys_has_aux(tmp_path: Any) -> None:
    from engine import plancache

    params, x, y = model()
    keys = {flag: plancache.cache_key(loss_fn, params, x, y, world_size=1, schedule="1f1b", has_aux=flag).digest()
            for flag in (True, False)}
    assert keys[True] != keys[False]


def test_calibration_runs_a_loss_with_aux(tmp_path: Any) -> None:
    params, x, y = model()
    step = engine.parallelize(loss_fn, params, x, y, microbatches=2, has_aux=True, calibrate=tmp_path / "cal.json")
    (loss, aux), _ = step(step.shard(params), x, y)
    _, (ref, ref_aux) = torch.func.grad_and_value(loss_fn, has_aux=True)(params, x, y)
    assert_close((loss, aux), (ref, ref_aux))
    assert (tmp_path / "cal.json").exists()
