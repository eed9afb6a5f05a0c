"""BatchNorm in train mode as state: per-microbatch batch statistics, full-step running statistics, the floor."""
from __future__ import annotations

import copy
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import ir
from engine.testing import assert_parallel_equivalent
from engine.training.module import updated
from tests.mpi.batchnorm import batch, bn_net
from tests.mpi.jobs import BIN, job_env, launch

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"]


def _bn_layers(net: nn.Module) -> dict[str, nn.BatchNorm2d]:
    return {n: m for n, m in net.named_modules() if isinstance(m, nn.BatchNorm2d)}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-13), (a, b)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_the_function_on_the_full_batch_is_pytorch_train_mode(momentum: float | None) -> None:
    """One call on the whole batch: the loss of the module in train mode, and the buffers it would write."""
    net = bn_net()
    for m in _bn_layers(net).values():
        m.momentum = momentum
    fn, variables = engine.functionalize(net.train(), loss=F.cross_entropy)
    x, y = batch()
    ref = copy.deepcopy(net)
    want = F.cross_entropy(ref(x), y)
    loss, state = fn(variables, x, y)
    _close(loss.detach(), want.detach())
    assert set(state["buffers"]) == set(_bn_layers(net))
    for name, m in _bn_layers(ref).items():
        got = state["buffers"][name]
        _close(got["running_mean"], m.running_mean)
        _close(got["running_var"], m.running_var)
        assert got["num_batches_tracked"].dtype == torch.int64 and int(got["num_batches_tracked"]) == 4
    assert all(int(m.num_batches_tracked) == 3 for m in _bn_layers(net).values())  # nothing written into the module


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dp", [1, 2])
def test_every_schedule_matches_the_microbatched_reference(schedule: str, dp: int) -> None:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    eq = assert_parallel_equivalent(fn, variables, x, y, schedule=schedule, dp=dp, microbatches=4 // dp)
    ranks = eq.plan.world_size
    assert eq.leaves == 13 + 6 * ranks  # 13 float grads, then 6 state leaves on every rank
    assert eq.max_rel_error < 1e-12


def test_running_statistics_are_one_update_over_every_microbatch_whatever_the_layout() -> None:
    """torchgpipe's deferred batch norm, computed here without fnpipe: each layer's running statistics move
    once, by the mean and unbiased variance of everything that layer saw in the step's microbatches."""
    net = bn_net()
    fn, variables = engine.functionalize(net.train(), loss=F.cross_entropy)
    x, y = batch()
    seen: dict[str, list[torch.Tensor]] = {}
    ref = copy.deepcopy(net)
    for name, m in _bn_layers(ref).items():
        m.register_forward_hook(lambda mod, inp, out, n=name: seen.setdefault(n, []).append(inp[0].detach()))
    for xc in x.chunk(4):
        ref(xc)
    states = []
    for layout in (dict(schedule="1f1b", stages=2, dp=1, microbatches=4), dict(schedule="gpipe", stages=4, dp=1,
                   microbatches=4), dict(schedule="zbv", stages=4, dp=2, microbatches=2),
                   dict(schedule="1f1b", stages=2, dp=1, microbatches=4, replicas=(2, 1)),
                   dict(schedule="1f1b", stages=3, dp=1, microbatches=4, replicas=(1, 2, 1))):
        positions = layout.get("replicas") or (1,) * (layout["stages"] // (2 if layout["schedule"] == "zbv" else 1))
        plan = engine.plan(fn, variables, x, y, world_size=sum(positions) * layout["dp"], has_aux=True,
                           min_microbatch_size=1, **layout)
        from engine.execution.inprocess import build_steps, run_steps
        result = run_steps(build_steps(fn, variables, (x, y), plan, has_aux=True), variables, (x, y))
        states.append(result.loss[1])
    for name, m in _bn_layers(net).items():
        var, mean = torch.var_mean(torch.cat(seen[name]), (0, 2, 3), correction=1)
        f = m.momentum if m.momentum is not None else 1 / (int(m.num_batches_tracked) + 1)
        for state in states:
            got = state["buffers"][name]
            _close(got["running_mean"], (1 - f) * m.running_mean + f * mean)
            _close(got["running_var"], (1 - f) * m.running_var + f * var)


def test_the_step_returns_state_that_updated_merges_into_sharded_variables() -> None:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    step = engine.parallelize(fn, variables, x, y, microbatches=1, has_aux=True)
    local = step.shard(variables)
    for _ in range(2):
        (loss, state), grads = step(local, x, y)
        local = updated(local, state)
    assert int(local["buffers"]["1"]["num_batches_tracked"]) == 5
    assert grads["buffers"]["1"]["running_mean"] is None or not grads["buffers"]["1"]["running_mean"].any()
    half = {"params": local["params"], "buffers": {**local["buffers"], "1": {k: None for k in local["buffers"]["1"]}}}
    assert all(v is None for v in updated(half, state)["buffers"]["1"].values())  # None stays None
    with pytest.raises(KeyError, match="'buffers.9'"):
        updated(local, {"buffers": {"9": {"running_mean": torch.zeros(4)}}})


def test_a_train_mode_function_needs_has_aux() -> None:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    with pytest.raises(engine.PlanError, match="has_aux=True"):
        engine.plan(fn, variables, x, y)


def test_the_floor_defaults_to_16_rows_with_batchnorm_in_train_mode() -> None:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch(64)
    assert ir.deferred_of(fn).min_microbatch == 16
    auto = engine.plan(fn, variables, x, y, world_size=2, microbatches="auto", has_aux=True)
    assert auto.microbatch_size >= 16 and auto.microbatches <= 4
    with pytest.raises(engine.PlanError, match=r"below 16 rows per microbatch.*BatchNorm in train mode \('1' and 1 "
                                               r"more layers\).*min_microbatch_size=N"):
        engine.plan(fn, variables, x, y, world_size=2, microbatches=8, has_aux=True)
    low = engine.plan(fn, variables, x, y, world_size=2, microbatches=8, has_aux=True, min_microbatch_size=8)
    assert low.microbatch_size == 8
    small = engine.plan(fn, variables, *batch(8), world_size=2, microbatches="auto", has_aux=True)
    assert small.microbatches == 1  # a batch under the floor still plans: one microbatch, the whole batch


def test_the_floor_option_applies_to_any_function() -> None:
    params = {"w": torch.randn(3, 2, dtype=torch.float64)}
    x = torch.randn(32, 3, dtype=torch.float64)
    fn = lambda p, x: (x @ p["w"]).pow(2).mean()  # noqa: E731
    assert engine.plan(fn, params, x, world_size=2, microbatches="auto", min_microbatch_size=8).microbatch_size >= 8
    with pytest.raises(engine.PlanError, match="min_microbatch_size must be a positive int"):
        engine.plan(fn, params, x, min_microbatch_size=0)


def test_other_running_stat_norms_are_still_refused() -> None:
    with pytest.raises(engine.ModuleError, match="InstanceNorm2d"):
        engine.functionalize(nn.Sequential(nn.InstanceNorm2d(3, track_running_stats=True)).train())


@pytest.mark.mpi
def test_batchnorm_under_mpirun() -> None:
    out = launch([str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                  "tests/mpi/batchnorm.py"], timeout=400, env=job_env())
    ok = set(re.findall(r"^OK rank (\d) bn (\S+) dp (\d)", out, flags=re.M))
    assert ok == {(str(r), s, str(d)) for r in range(2) for s in SCHEDULES for d in (1, 2)}, out
    evals = set(re.findall(r"^OK rank (\d) eval dp (\d)", out, flags=re.M))
    assert evals == {(str(r), str(d)) for r in range(2) for d in (1, 2)}, out


def test_mixed_precision_keeps_the_running_statistics_full_step() -> None:
    """compute_dtype=bfloat16: the microbatch half runs in bf16, the statistics still combine over the step."""
    net = bn_net().float()
    fn, variables = engine.functionalize(net.train(), loss=F.cross_entropy)
    x, y = batch()
    step = engine.parallelize(fn, variables, x.float(), y, microbatches=4, has_aux=True, min_microbatch_size=1,
                              compute_dtype=torch.bfloat16)
    assert step.planned.finish is not None  # the statistics are combined over the step, not finished per microbatch
    (loss, state), _ = step(step.shard(variables), x.float(), y)
    _, ref = fn(variables, x.float(), y)  # float32, one microbatch: the first layer's statistics are the same
    got, want = state["buffers"]["1"], ref["buffers"]["1"]
    assert loss.dtype == torch.float32 and got["running_var"].dtype == torch.float32
    assert torch.allclose(got["running_mean"], want["running_mean"], rtol=2e-2, atol=2e-2)
    assert torch.allclose(got["running_var"], want["running_var"], rtol=2e-2, atol=2e-2)
    assert step.evaluate(step.shard(variables), x.float()).shape == (16, 5)


def test_a_train_mode_model_plans_for_gpus_on_a_cpu_only_machine() -> None:
    """Tracing for "cuda" runs no kernel, so a CPU-only torch plans a GPU job (the README's promise)."""
    fn, variables = engine.functionalize(bn_net().float().train(), loss=F.cross_entropy)
    x, y = batch()
    g = ir.trace(fn, variables, x.float(), y, device="cuda")
    ops = [e.op for e in g.eqns]
    assert "aten.native_batch_norm.default" in ops and "aten.var_mean.correction" not in ops


def test_each_layer_sends_one_partial_and_no_later_layers_buffers() -> None:
    """A cut sends the hidden state and one [6, C] partial per train-mode BN layer before it, nothing else
    (before ir.sink, every later layer's detached buffers crossed too)."""
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    g = ir.trace(fn, variables, x, y)
    first_relu = next(i for i, e in enumerate(g.eqns) if e.op == "aten.relu.default")
    sent = [list(g.defined())[v].aval for v in ir.split(g, [first_relu + 1])[0].acts_out]
    assert sorted(tuple(a.shape) for a in sent) == sorted([tuple(x.shape[:1]) + (4, 6, 6), (6, 4)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_layers_updated_together_give_each_layers_own_update(dtype: torch.dtype) -> None:
    """`finish` updates the layers with the same settings in one go (their partials side by side): the same
    numbers, bit for bit, as each layer finished alone, in the same tree, each leaf with its own storage."""
    from engine.training.batchnorm import finish, nest

    torch.manual_seed(0)
    settings = [(3, 0.1, 1e-5), (8, None, 1e-5), (5, 0.1, 1e-5), (16, 0.1, 1e-3), (7, None, 1e-5)]
    layers = {f"block{i}.bn": nn.BatchNorm2d(c, momentum=mom, eps=eps).to(dtype)
              for i, (c, mom, eps) in enumerate(settings)}
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rows = {name: torch.stack([torch.randn(c), torch.rand(c) + 1, torch.randn(c), torch.rand(c) + 0.5,
                               torch.full((c,), 64.0), torch.full((c,), 3.0)]).to(acc)
            for name, (c, _, _) in zip(layers, settings)}
    together = finish(layers)(nest(rows), 4)["buffers"]
    assert list(together) == [name.split(".")[0] for name in layers]  # the traced order
    for name, layer in layers.items():
        alone = finish({name: layer})(nest({name: rows[name]}), 4)["buffers"]
        block, bn = name.split(".")
        for key, value in alone[block][bn].items():
            got = together[block][bn][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (name, key)
            assert got.untyped_storage().nbytes() == got.numel() * got.element_size(), (name, key)
