"""Run under mpirun -n 2: parallelize(rebalance=True) re-splits from the measured programs, and the step on
the new cuts equals torch.func.grad (float64).

The last stage's measured seconds are made 3 x what the clock said (a stand-in for a stage the compiler sped
up less than the others), so a re-split is always predicted faster. Prints, per
schedule, `OK|FAIL rank R <schedule> cuts <before> -> <after> max rel err <e>`.
"""
from __future__ import annotations

import os
import sys

import attrs
import torch
from torch.utils import _pytree as pytree

import engine
from engine.execution import executor
from tests.mpi import models

RTOL = 1e-10
SCHEDULES = {"1f1b": 1, "zb-h1": 1, "zbv": 2, "interleaved-1f1b": 2}  # stages per rank
real_measure = executor.measure


def slow_last(runs, device, **kw):  # type: ignore[no-untyped-def]
    """The measured programs, the last stage's 3 x slower."""
    return tuple(attrs.evolve(c, seconds=3 * c.seconds) if c.stage == STATE["last"] else c
                 for c in real_measure(runs, device, **kw))


STATE = {"last": -1}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(schedule: str, v: int, rank: int) -> str:
    params = models.init_params(dtype=torch.float64, layers=8, width=16)
    batch = models.batch(size=16)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    STATE["last"] = 2 * v - 1
    with engine.parallelize(models.loss_fn, params, *batch, schedule=schedule, stages=2 * v, microbatches=4,
                            rebalance=True, **({"stages_per_rank": 2} if v == 2 else {})) as step:
        moved = step.rebalanced
        loss, grads = step(step.shard(params), *batch)
        after = list(step.plan.cuts)
    errs = [rel_err(loss.cpu(), ref_loss)]
    errs += [rel_err(g.cpu(), r) for g, r in zip(pytree.tree_leaves(grads, is_leaf=lambda x: x is None),
                                                  pytree.tree_leaves(ref)) if g is not None]
    worst = max(errs)
    ok = moved is not None and list(moved.planned.plan.cuts) == after and worst <= RTOL
    before = None if moved is None else list(moved.cuts_before)
    return f"{'OK' if ok else 'FAIL'} rank {rank} {schedule} cuts {before} -> {after} max rel err {worst:.2e}"


def transformers_llama(rank: int) -> str:
    """A model we did not write: transformers' Llama (tiny config, float64, 4 stages of zbv) re-split from its
    last stage measured 3 x slow; loss and every grad leaf against torch.func.grad."""
    from tests.models.zoo import causal_lm

    case = causal_lm("llama")
    ref_loss, ref = torch.func.grad_and_value(case.fn)(case.params, *case.batch)[::-1]
    STATE["last"] = 3
    executor.measure = slow_last
    with engine.parallelize(case.fn, case.params, *case.batch, schedule="zbv", stages=4, microbatches=4,
                            rebalance=True) as step:
        moved = step.rebalanced
        loss, grads = step(step.shard(case.params), *case.batch)
        after = list(step.plan.cuts)
    errs = [rel_err(loss.cpu(), ref_loss)]
    errs += [rel_err(g.cpu(), r) for g, r in zip(pytree.tree_leaves(grads, is_leaf=lambda x: x is None),
                                                  pytree.tree_leaves(ref)) if g is not None]
    ok = moved is not None and max(errs) <= RTOL
    before = None if moved is None else list(moved.cuts_before)
    return f"{'OK' if ok else 'FAIL'} rank {rank} transformers-llama cuts {before} -> {after} max rel err {max(errs):.2e}"


def cached(rank: int) -> str:
    """With plan_cache: the entry keeps the planner's plan; a second launch measuring the same re-splits to the
    same cuts (a re-split plan's times carry the scale it was made under, so it is never what is measured
    against), and one with rebalance=False runs the planner's cuts."""
    import tempfile

    params = models.init_params(dtype=torch.float64, layers=8, width=16)
    batch = models.batch(size=16)
    where = os.environ.get("FNPIPE_TEST_PLAN_CACHE") or f"{tempfile.gettempdir()}/fnpipe-rebalance-{os.getppid()}"
    opts = dict(schedule="1f1b", stages=2, microbatches=4, plan_cache=where)
    STATE["last"] = 1
    executor.measure = slow_last
    cuts = []
    for _ in range(2):
        with engine.parallelize(models.loss_fn, params, *batch, rebalance=True, **opts) as step:
            cuts.append((list(step.rebalanced.cuts_before) if step.rebalanced else None, list(step.plan.cuts)))
    executor.measure = real_measure
    with engine.parallelize(models.loss_fn, params, *batch, rebalance=False, **opts) as step:
        planner = list(step.plan.cuts)
    (before, first), (before2, second) = cuts
    ok = before is not None and first != before and (before2, second) == (before, first) and planner == before
    return f"{'OK' if ok else 'FAIL'} rank {rank} plan_cache cuts {before} -> {first} max rel err 0"


def main() -> int:
    executor.measure = slow_last
    world = engine.init()
    lines = [check(name, v, world.rank) for name, v in SCHEDULES.items()]
    lines.append(transformers_llama(world.rank))
    lines.append(cached(world.rank))
    for line in lines:
        print(line, flush=True)
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
