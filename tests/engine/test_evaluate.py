"""step.evaluate: a forward-only program on the training plan's stages returns the eval-mode outputs (logits)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.execution.inprocess import build_steps, run_each
from engine.training.module import load_into, updated
from tests.mpi.batchnorm import batch, bn_net

LAYOUTS = [("1f1b", 2, 1), ("gpipe", 2, 2), ("zbv", 4, 1), ("interleaved-1f1b", 4, 1), ("zb-h1", 2, 1)]


def _steps(schedule: str, stages: int, dp: int) -> tuple:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    world = stages // (2 if schedule in ("zbv", "interleaved-1f1b") else 1) * dp
    plan = engine.plan(fn, variables, x, y, world_size=world, schedule=schedule, stages=stages, dp=dp, microbatches=2,
                       has_aux=True, min_microbatch_size=1)
    return fn, variables, x, y, build_steps(fn, variables, (x, y), plan, has_aux=True)


@pytest.mark.parametrize("schedule,stages,dp", LAYOUTS)
def test_every_layout_returns_the_eval_mode_logits(schedule: str, stages: int, dp: int) -> None:
    fn, variables, x, _, steps = _steps(schedule, stages, dp)
    want = copy.deepcopy(bn_net()).eval()(x).detach()
    every = run_each(steps, lambda s: s.evaluate(s.shard(variables), x, forward=fn.forward))
    for got in every:
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    local = run_each(steps, lambda s: s.evaluate(s.shard(variables), x, forward=fn.forward, gather="local"))
    last = [r for r, s in enumerate(steps) if s.table.rank_of(s.plan.num_stages - 1) == s.position]
    assert [r for r, got in enumerate(local) if got is not None] == last
    rows = torch.cat([local[r] for r in last])
    assert torch.allclose(rows, want, rtol=1e-12, atol=1e-14)


REPLICAS = [("1f1b", (2, 1), 1), ("1f1b", (1, 2), 1), ("1f1b", (2, 1, 1), 1), ("1f1b", (1, 2, 1), 1),
            ("gpipe", (2, 1), 2), ("zbv", (1, 2), 1)]


@pytest.mark.parametrize("schedule,replicas,dp", REPLICAS)
def test_unequal_replicas_return_the_eval_mode_logits(schedule: str, replicas: tuple[int, ...], dp: int) -> None:
    """A position replicated k times runs microbatch i on its replica i mod k, for evaluate as for training:
    the logits are the module's, and gather="local" gives each last-position rank its microbatches' rows."""
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    stages = len(replicas) * (2 if schedule == "zbv" else 1)
    m = 4 // dp
    plan = engine.plan(fn, variables, x, y, world_size=sum(replicas) * dp, schedule=schedule, stages=stages,
                       replicas=replicas, dp=dp, microbatches=m, has_aux=True, min_microbatch_size=1)
    assert plan.replicas == replicas
    steps = build_steps(fn, variables, (x, y), plan, has_aux=True)
    want = copy.deepcopy(bn_net()).eval()(x).detach()
    for got in run_each(steps, lambda s: s.evaluate(s.shard(variables), x, forward=fn.forward)):
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    local = run_each(steps, lambda s: s.evaluate(s.shard(variables), x, forward=fn.forward, gather="local"))
    rows, last = len(x) // (m * dp), steps[0].table.rank_of(plan.num_stages - 1)  # zbv: the V ends on position 0
    for s, got in zip(steps, local):
        if s.position != last:
            assert got is None
            continue
        mine = [(s.replica * m + mb) * rows for mb in s.microbatches]
        assert len(mine) == m // replicas[last]
        assert torch.allclose(got, torch.cat([want[i:i + rows] for i in mine]), rtol=1e-12, atol=1e-14)


def test_train_then_evaluate_then_train_plans_once_and_uses_the_new_running_statistics(tmp_path: Path) -> None:
    net = bn_net()
    fn, variables = engine.functionalize(net.train(), loss=F.cross_entropy)
    x, y = batch()
    step = engine.parallelize(fn, variables, x, y, microbatches=2, has_aux=True, min_microbatch_size=1,
                              plan_cache=tmp_path)
    planned, local = step.planned, step.shard(variables)
    (_, state), _ = step(local, x, y)
    local = updated(local, state)
    logits = step.evaluate(local, x)
    ref = copy.deepcopy(net)
    load_into(ref, local)
    assert torch.allclose(logits, ref.eval()(x).detach(), rtol=1e-12, atol=1e-14)
    assert not torch.allclose(logits, net.eval()(x).detach())  # the old statistics give other logits
    (_, state), _ = step(local, x, y)
    assert step.planned is planned and len(list(tmp_path.glob("plan-*.json"))) == 1
    assert int(state["buffers"]["1"]["num_batches_tracked"]) == 5
    assert len(step.evaluators) == 1 and step.evaluate(local, x[:8]).shape == (8, 5)  # a new shape: traced once more
    assert len(step.evaluators) == 2


def test_evaluate_refuses_what_it_cannot_run() -> None:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    step = engine.parallelize(fn, variables, x, y, microbatches=2, has_aux=True, min_microbatch_size=1)
    local = step.shard(variables)
    with pytest.raises(engine.PlanError, match="not a mean"):
        step.evaluate(local, x, forward=lambda v, x: fn.forward(v, x).mean())
    with pytest.raises(engine.PlanError, match="gather must be one of"):
        step.evaluate(local, x, gather="rank0")
    with pytest.raises(engine.PlanError, match="equal parts"):
        step.evaluate(local, x[:3])
    plain = engine.parallelize(lambda p, x: (x @ p).pow(2).mean(), torch.randn(3, 2), torch.randn(4, 3),
                               microbatches=2)
    with pytest.raises(engine.PlanError, match="pass forward=fn"):
        plain.evaluate(torch.randn(3, 2), torch.randn(4, 3))
