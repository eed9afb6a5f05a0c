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
real_measure = executor.Executor.measure


def slow_last(self, stages, **kw):  # type: ignore[no-untyped-def]
    """Executor.measure with deterministic seconds (CPU timings of these tiny programs are noise on a shared
    machine): 0.1 ms per equation of the program's graph, the last stage's 3 x (a stand-in for a stage the
    compiler sped up less than the others); the programs still run and are timed."""
    costs = real_measure(self, stages, **kw)
    return tuple(attrs.evolve(c, seconds=1e-4 * len(getattr(self.infos[c.stage].ad, c.kind).graph.eqns)
                              * (STATE["factor"] if c.stage == STATE["last"] else 1)) for c in costs)


STATE = {"last": -1, "factor": 3}


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


def transformers_llama(rank: int, mode: bool | str = True) -> str:
    """A model we did not write: transformers' Llama (tiny config, float64, 4 stages of zbv) re-split from its
    last stage measured 6 x slow (`mode` True: the programs measured in turn; "step": inside traced steps);
    loss and every grad leaf against torch.func.grad."""
    from engine.execution import rebalance as rebalancing
    from tests.models.zoo import causal_lm

    case = causal_lm("llama")
    ref_loss, ref = torch.func.grad_and_value(case.fn)(case.params, *case.batch)[::-1]
    STATE["last"], STATE["factor"] = 3, 6  # at 3 x the planner's split (its ranks balanced) is still the best
    executor.Executor.measure = slow_last
    real, calls = rebalancing.in_steps, []
    rebalancing.in_steps = deterministic_in_steps(real, calls)
    try:
        with engine.parallelize(case.fn, case.params, *case.batch, schedule="zbv", stages=4, microbatches=4,
                                rebalance=mode) as step:
            moved = step.rebalanced
            loss, grads = step(step.shard(case.params), *case.batch)
            after = list(step.plan.cuts)
    finally:
        rebalancing.in_steps = real
        STATE["factor"] = 3
    errs = [rel_err(loss.cpu(), ref_loss)]
    errs += [rel_err(g.cpu(), r) for g, r in zip(pytree.tree_leaves(grads, is_leaf=lambda x: x is None),
                                                  pytree.tree_leaves(ref)) if g is not None]
    ok = moved is not None and max(errs) <= RTOL and (moved.stepped is not None) == (mode == "step")
    before = None if moved is None else list(moved.cuts_before)
    name = "transformers-llama" + ("-in-steps" if mode == "step" else "")
    return f"{'OK' if ok else 'FAIL'} rank {rank} {name} cuts {before} -> {after} max rel err {max(errs):.2e}"


def reverted(rank: int) -> str:
    """A re-split whose own programs then measure slower (every program 10 x from the third profile on: the
    first two are the running step's, measured and measured again; the new split's are measured twice too)
    goes back to the planner's cuts, measured once more, with loss and grads still those of torch.func.grad."""
    params = models.init_params(dtype=torch.float64, layers=8, width=16)
    batch = models.batch(size=16)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    profiles = []

    def slow_then_slower(self, stages, **kw):  # type: ignore[no-untyped-def]
        costs = slow_last(self, stages, **kw)  # one call a profile
        profiles.append(len(profiles))
        return tuple(attrs.evolve(c, seconds=10 * c.seconds) for c in costs) if len(profiles) > 2 else costs

    STATE["last"] = 1
    executor.Executor.measure = slow_then_slower
    with engine.parallelize(models.loss_fn, params, *batch, schedule="1f1b", stages=2, microbatches=4,
                            rebalance=True) as step:
        cuts, moved = list(step.plan.cuts), step.rebalanced
        loss, grads = step(step.shard(params), *batch)
    executor.Executor.measure = slow_last
    errs = [rel_err(loss.cpu(), ref_loss)]
    errs += [rel_err(g.cpu(), r) for g, r in zip(pytree.tree_leaves(grads, is_leaf=lambda x: x is None),
                                                  pytree.tree_leaves(ref)) if g is not None]
    ok = moved is None and len(profiles) == 5 and max(errs) <= RTOL
    return f"{'OK' if ok else 'FAIL'} rank {rank} reverted cuts {cuts} -> {cuts} max rel err {max(errs):.2e}"


def noisy(rank: int) -> str:
    """A stage measured 3 x slow once (a hiccup of a shared device), in the first measurement or in the one
    made again, does not drive the split: each launch ends on the cuts of a launch measured without the
    hiccup (not the cuts the 3 x stage moves to when measured so both times), its programs measured four
    times where it re-splits (twice before, twice after), and it equals torch.func.grad."""
    params = models.init_params(dtype=torch.float64, layers=8, width=16)
    batch = models.batch(size=16)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    opts = dict(schedule="1f1b", stages=2, microbatches=4, rebalance=True)
    seen = {"measured": 0, "hiccup_at": 1}  # this launch's measurements so far; which one is 3 x slow

    def slow_once(self, stages, **kw):  # type: ignore[no-untyped-def]
        seen["measured"] += 1
        STATE["last"] = 1 if seen["measured"] == seen["hiccup_at"] else -1
        return slow_last(self, stages, **kw)

    executor.Executor.measure = slow_last
    STATE["last"] = -1
    with engine.parallelize(models.loss_fn, params, *batch, **opts) as step:
        steady = list(step.plan.cuts)
    STATE["last"] = 1
    with engine.parallelize(models.loss_fn, params, *batch, **opts) as step:
        hiccup = list(step.plan.cuts)  # what the 3 x stage moves to when it is measured so both times
    executor.Executor.measure = slow_once
    with engine.parallelize(models.loss_fn, params, *batch, **opts) as step:
        cuts, moved = list(step.plan.cuts), step.rebalanced
        loss, grads = step(step.shard(params), *batch)
    measured = [seen["measured"]]
    seen.update(measured=0, hiccup_at=2)
    with engine.parallelize(models.loss_fn, params, *batch, **opts) as step:
        later, moved_later = list(step.plan.cuts), step.rebalanced
    measured.append(seen["measured"])
    executor.Executor.measure = slow_last
    errs = [rel_err(loss.cpu(), ref_loss)]
    errs += [rel_err(g.cpu(), r) for g, r in zip(pytree.tree_leaves(grads, is_leaf=lambda x: x is None),
                                                  pytree.tree_leaves(ref)) if g is not None]
    ok = (cuts == later == steady != hiccup and measured == [4 if moved else 2, 4 if moved_later else 2]
          and max(errs) <= RTOL)
    before = None if moved is None else list(moved.cuts_before)
    return f"{'OK' if ok else 'FAIL'} rank {rank} noisy cuts {before} -> {cuts} max rel err {max(errs):.2e}"


def cached(rank: int) -> str:
    """With plan_cache: the entry keeps the planner's plan; a second launch re-splits again from the planner's
    cuts to the same new cuts (a re-split plan's times carry the scale it was made under, so it is never what
    is measured against), and one with rebalance=False runs the planner's cuts."""
    import tempfile

    params = models.init_params(dtype=torch.float64, layers=8, width=16)
    batch = models.batch(size=16)
    where = os.environ.get("FNPIPE_TEST_PLAN_CACHE") or f"{tempfile.gettempdir()}/fnpipe-rebalance-{os.getppid()}"
    opts = dict(schedule="1f1b", stages=2, microbatches=4, plan_cache=where)
    STATE["last"] = 1
    executor.Executor.measure = slow_last
    cuts = []
    for _ in range(2):
        with engine.parallelize(models.loss_fn, params, *batch, rebalance=True, **opts) as step:
            cuts.append((list(step.rebalanced.cuts_before) if step.rebalanced else None, list(step.plan.cuts)))
    executor.Executor.measure = real_measure
    with engine.parallelize(models.loss_fn, params, *batch, rebalance=False, **opts) as step:
        planner = list(step.plan.cuts)
    (before, first), (before2, second) = cuts
    ok = before is not None and first != before and (before2, second) == (before, first) and planner == before
    return f"{'OK' if ok else 'FAIL'} rank {rank} plan_cache cuts {before} -> {first} max rel err 0"


def failing(rank: int) -> str:
    """A rank whose re-split raises (here rank 1's search, with an error the re-split does not expect) tells
    the other before either raises: rank 1 raises its own error, rank 0 RuntimeMismatchError naming rank 1,
    both at once rather than after a collective's timeout."""
    import importlib
    import time

    params = models.init_params(dtype=torch.float64, layers=8, width=16)
    batch = models.batch(size=16)
    module = importlib.import_module("engine.parallelize")
    real_search = module.search
    calls = []

    def search(*args, **kw):  # type: ignore[no-untyped-def]
        if kw.get("measured") is not None and rank == 1:
            raise ValueError("a search that breaks on rank 1")
        calls.append(1)
        return real_search(*args, **kw)

    STATE["last"] = 1
    executor.Executor.measure = slow_last
    module.search = search
    start = time.monotonic()
    try:
        with engine.parallelize(models.loss_fn, params, *batch, schedule="1f1b", stages=2, microbatches=4,
                                rebalance=True, timeout=60):
            got = "no error"
    except engine.RuntimeMismatchError as exc:
        got = "mismatch naming rank 1" if "rank 1 failed while re-splitting" in str(exc) else f"mismatch: {exc}"
    except ValueError as exc:
        got = f"own error: {exc}"
    finally:
        module.search = real_search
    waited = time.monotonic() - start
    want = "own error: a search that breaks on rank 1" if rank == 1 else "mismatch naming rank 1"
    ok = got == want and waited < 30
    return f"{'OK' if ok else 'FAIL'} rank {rank} failing cuts [{got}] -> [{waited:.1f} s] max rel err 0"


def deterministic_in_steps(real, calls: list, *, slower_after: bool = False):  # type: ignore[no-untyped-def]
    """`rebalance.in_steps` that runs and traces the steps (`real`), then gives each program deterministic
    seconds (0.1 ms an equation, the last stage STATE["factor"] x, as `slow_last`) and the step time the
    schedule simulates under them (10 x from the second call with `slower_after`), appending it to `calls`."""
    from engine.execution import profile as profiles

    def in_steps(step, params, example_batch, **kw):  # type: ignore[no-untyped-def]
        traced, seconds = real(step, params, example_batch, **kw)
        assert seconds > 0 and not step.inputs.checked  # the user's first step is still compared
        fixed = profiles.Profile(attrs.evolve(c, seconds=1e-4 * len(getattr(
            step.executor.infos[c.stage].ad, c.kind).graph.eqns) * (STATE["factor"] if c.stage == STATE["last"] else 1))
            for c in traced.programs)
        seconds = profiles.predicted_step_time(step.plan, step.table, step.programs.all(), fixed) * (
            10 if slower_after and calls else 1)
        calls.append(seconds)
        return fixed, seconds

    return in_steps


def in_steps_case(rank: int, *, slower_after: bool) -> str:
    """rebalance="step": the programs' seconds from traced steps (the steps run and are traced; their seconds
    are replaced by deterministic ones, 0.1 ms an equation and the last stage 3 x, as for the measured
    programs above), and each split's step time that schedule simulated under them. The re-split is kept
    where its steps run faster, with loss and grads those of torch.func.grad; with the new split's traced
    steps made 10 x slower (`slower_after`), the planner's cuts are started again."""
    from engine.execution import rebalance as rebalancing

    params = models.init_params(dtype=torch.float64, layers=8, width=16)
    batch = models.batch(size=16)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    real = rebalancing.in_steps
    calls: list[float] = []
    in_steps = deterministic_in_steps(real, calls, slower_after=slower_after)

    STATE["last"] = 1
    rebalancing.in_steps = in_steps
    try:
        with engine.parallelize(models.loss_fn, params, *batch, schedule="1f1b", stages=2, microbatches=4,
                                rebalance="step") as step:
            moved, after = step.rebalanced, list(step.plan.cuts)
            inputs_fresh = not step.inputs.checked
            loss, grads = step(step.shard(params), *batch)
            inputs_fresh = inputs_fresh and step.inputs.checked  # the first step compared them
    finally:
        rebalancing.in_steps = real
        STATE["factor"] = 3
    errs = [rel_err(loss.cpu(), ref_loss)]
    errs += [rel_err(g.cpu(), r) for g, r in zip(pytree.tree_leaves(grads, is_leaf=lambda x: x is None),
                                                  pytree.tree_leaves(ref)) if g is not None]
    if slower_after:
        with engine.parallelize(models.loss_fn, params, *batch, schedule="1f1b", stages=2, microbatches=4,
                                rebalance=False) as planner:
            planned = list(planner.plan.cuts)
        ok = moved is None and len(calls) == 2 and calls[1] > calls[0] and after == planned and inputs_fresh
        name, before = "in-steps-reverted", planned
    else:
        ok = (moved is not None and moved.stepped == (calls[0], calls[1]) and calls[1] < calls[0]
              and list(moved.planned.plan.cuts) == after and "inside steps" in str(moved) and inputs_fresh)
        name, before = "in-steps", None if moved is None else list(moved.cuts_before)
    ok = ok and max(errs) <= RTOL
    return f"{'OK' if ok else 'FAIL'} rank {rank} {name} cuts {before} -> {after} max rel err {max(errs):.2e}"


def main() -> int:
    executor.Executor.measure = slow_last
    world = engine.init()
    lines = [check(name, v, world.rank) for name, v in SCHEDULES.items()]
    lines.append(transformers_llama(world.rank))
    lines.append(transformers_llama(world.rank, "step"))
    lines.append(reverted(world.rank))
    lines.append(noisy(world.rank))
    lines.append(cached(world.rank))
    lines.append(in_steps_case(world.rank, slower_after=False))
    lines.append(in_steps_case(world.rank, slower_after=True))
    lines.append(failing(world.rank))  # last: the ranks part on an error
    for line in lines:
        print(line, flush=True)
    return 1 if any(line.startswith("FAIL") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
