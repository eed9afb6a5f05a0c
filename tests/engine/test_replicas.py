"""Replicas per stage: a stage on more ranks than another, in process against torch.func.grad, planned, printed."""
from __future__ import annotations

import threading
from collections import Counter

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest
import torch
from torch.utils import _pytree as pytree

import engine
import engine.testing
from engine.errors import PlanError
from engine.execution import routing
from engine.execution.assemble import channels, reduce_groups
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.plan import Plan, StagePlan
from engine.testing.plans import replica_counts
from tests.mpi import models

PARAMS = models.init_params(layers=4)

# (schedule, stages, replicas per pipeline rank, schedule options, dp, microbatches)
CASES = [
    ("gpipe", 2, (2, 1), (), 1, 4),
    ("1f1b", 2, (2, 1), (), 1, 4),
    ("1f1b", 3, (2, 1, 1), (), 1, 4),
    ("zb-h1", 2, (1, 3), (), 1, 6),
    ("zbv", 4, (2, 1), (), 1, 4),
    ("interleaved-1f1b", 4, (1, 2), (("stages_per_rank", 2),), 1, 4),
    ("1f1b", 2, (2, 1), (), 2, 4),
]


def _plan(schedule: str, stages: int, counts: tuple[int, ...], options: tuple, dp: int, m: int, order: str) -> Plan:
    return Plan(schedule, stages, len(counts), dp, m, tuple(7 * k for k in range(1, stages)),
                stages=tuple(StagePlan(k, 0, 0, 0) for k in range(stages)), schedule_options=options,
                replicas=counts, replica_order=order)


def _verify_all(steps) -> None:
    """Every rank's Step.verify at once (a collective): plans alike, every send met by its receive."""
    errors = []

    def work(step) -> None:
        try:
            step.verify()
        except Exception as exc:  # noqa: BLE001 -- collected for the assert below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


@pytest.mark.parametrize("order", ["split", "own"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[2]))}-dp{c[4]}")
def test_unequal_replicas_equal_torch_func_grad_in_process(case: tuple, order: str) -> None:
    schedule, stages, counts, options, dp, m = case
    batch = models.batch(size=4 * m * dp)
    plan = _plan(schedule, stages, counts, options, dp, m, order)
    assert plan.world_size == sum(counts) * dp
    steps = build_steps(models.loss_fn, PARAMS, batch, plan)
    _verify_all(steps)
    ran = Counter((ins.stage, ins.mb, steps[r].replica) for r, s in enumerate(steps)
                  for ins in s.program.instrs if ins.kind == "forward")
    assert ran == Counter((s, mb, d) for s in range(stages) for mb in range(m) for d in range(dp))  # each once
    result = run_steps(steps, PARAMS, batch)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(PARAMS, *batch)[::-1]
    torch.testing.assert_close(result.loss, ref_loss, rtol=1e-10, atol=0)
    names = steps[0].graph.input_names[:steps[0].graph.num_params]
    for name, got, want in zip(names, pytree.tree_leaves(result.grads), pytree.tree_leaves(ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14, msg=name)
    for step, (loss, _) in zip(steps, result.per_rank):  # every rank returns the full-batch loss
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=0)


def test_a_rank_runs_the_microbatches_it_owns_and_sends_each_to_its_owner() -> None:
    plan = _plan("1f1b", 2, (2, 1), (), 1, 4, "split")
    steps = build_steps(models.loss_fn, PARAMS, models.batch(size=16), plan)
    assert [routing.microbatches(plan, r) for r in range(3)] == [(0, 2), (1, 3), (0, 1, 2, 3)]
    sends = {r: [(c.mb, c.peer) for ins in s.program.instrs for c in ins.comm if c.op == "send"]
             for r, s in enumerate(steps)}
    assert sends[0] == [(0, 2), (2, 2)] and sends[1] == [(1, 2), (3, 2)]
    assert sends[2] == [(0, 0), (1, 1), (2, 0), (3, 1)]  # grads go back to the replica that sent the activations
    planned = steps[0].planned
    assert channels(planned) == [(0, 2), (1, 2), (2, 0), (2, 1)]
    groups = {g: sorted(steps[0].graph.input_names[p] for p in pids)
              for g, pids in routing.grad_groups(plan, planned.stages, planned.table, planned.num_params).items()}
    assert groups[(0, 1)][:2] == ["layers.0.b", "layers.0.ln"]  # stage 0's own leaves: summed over its replicas
    assert groups[(0, 1, 2)] == ["embed"]  # tied: the embedding on stage 0's replicas and the head on stage 1
    assert sorted(reduce_groups(planned)) == sorted(groups)


# -- planning -----------------------------------------------------------------------------------------------

def _dominated() -> tuple:
    """One matmul of 8192 x 8192 (a block no cut can split) and three small layers, on meta tensors."""
    def loss_fn(p, x, y):
        h = torch.tanh(x @ p["big"])
        h = torch.tanh(torch.tanh(h @ p["s1"]) @ p["s2"])
        return ((h @ p["s3"] - y) ** 2).mean()

    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    params = {"big": meta(8192, 8192), "s1": meta(8192, 64), "s2": meta(64, 64), "s3": meta(64, 4)}
    return loss_fn, params, meta(256, 8192), meta(256, 4)


@pytest.mark.parametrize("world, counts", [(3, (2, 1)), (4, (2, 1, 1))])
def test_the_planner_replicates_the_stage_that_dominates(world: int, counts: tuple) -> None:
    fn, params, x, y = _dominated()
    kw = dict(world_size=world, stages="auto", dp=1, microbatches="auto", device="h100")
    chosen = engine.plan(fn, params, x, y, **kw)
    assert chosen.replicas == counts and chosen.stages[0].names == ("big",)
    assert chosen.world_size == world and chosen.microbatches % 2 == 0
    assert chosen.equal_step_time > chosen.predicted_step_time / (1 - 0.05)
    equal = engine.plan(fn, params, x, y, **{**kw, "stages": world})  # every rank its own stage: the big one alone
    assert equal.replicas == (1,) * world
    assert chosen.equal_step_time == pytest.approx(equal.predicted_step_time, rel=1e-9)
    text = str(chosen).splitlines()
    assert text[len(chosen.stages) + 1].startswith(f"1f1b: {len(counts)} stages on {world} ranks (replicas "
                                                   f"{'x'.join(map(str, counts))}) x dp 1")
    assert "unequal replicas chosen" in str(chosen) and "for the best plan with equal replicas" in str(chosen)


def test_the_planner_keeps_equal_replicas_when_stages_balance() -> None:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    p = engine.plan(models.loss_fn, params, *batch, world_size=4, stages="auto", dp="auto", microbatches=4)
    assert p.replicas == (1,) * p.pipeline_depth and p.equal_step_time == 0.0
    assert "replicas" not in str(p)


def test_explicit_replicas_balance_time_per_replica() -> None:
    """replicas=(2, 1): the splitter gives stage 0 about twice the time of stage 1."""
    params, batch = models.init_params(layers=4), models.batch(size=16)
    p = engine.plan(models.loss_fn, params, *batch, world_size=3, replicas=(2, 1), microbatches=4)
    assert p.replicas == (2, 1) and p.dp == 1 and p.replica_order in ("split", "own")
    assert p.stages[0].time > 1.3 * p.stages[1].time
    q = engine.plan(models.loss_fn, params, *batch, world_size=6, replicas=[1, 2], microbatches=4)
    assert q.replicas == (1, 2) and q.dp == 2 and q.world_size == 6 and q.stages[1].time > 1.3 * q.stages[0].time


GOLDEN = """\
stage rank      eqns modules                    params M    GFLOP  fwd ms  bwd ms       act      peak      send
    0  0-1       0-9 wte + blocks.0-1                1.5      3.0    2.00    4.00   4.8 MiB   1.9 GiB 976.6 KiB
    1    2     10-24 blocks.2-3 + ln_f + wte         1.0      4.5    1.00    2.00   7.2 MiB 953.7 MiB       0 B
1f1b: 2 stages on 3 ranks (replicas 2x1) x dp 2 = 6 ranks; 8 microbatches of 2
replicas per stage: stage 0 x2 on ranks 0-1, stage 1 x1 on rank 2 in dp replica 0; microbatch i runs on replica \
i mod count, in the own order
unequal replicas chosen: predicted 30.00 ms against 45.00 ms for the best plan with equal replicas (50% faster)
predicted step 30.00 ms (dp all-reduce 1.00 ms), bubble 10.0%
device h100, link nvlink, memory limit 74.5 GiB; planned peak per rank 1.9 GiB, 953.7 MiB"""


def test_a_replicated_plan_prints_its_replicas_and_why_golden() -> None:
    first = StagePlan(0, 0, 10, 0, forward_time=2e-3, backward_weight_time=4e-3, param_bytes=6_000_000,
                      flops=3 * 10**9, activation_bytes=5_000_000, send_bytes=1_000_000, peak_memory=2 * 10**9,
                      names=("wte", "blocks.0.w", "blocks.1.w"), num_params=1_500_000)
    last = StagePlan(1, 10, 25, 1, forward_time=1e-3, backward_input_time=1e-3, backward_weight_time=1e-3,
                     param_bytes=4_000_000, flops=45 * 10**8, activation_bytes=7_500_000, peak_memory=10**9,
                     names=("blocks.2.w", "blocks.3.w", "ln_f.weight", "wte"), num_params=1_000_000)
    p = Plan("1f1b", 2, 2, 2, 8, (10,), (first, last), predicted_step_time=0.030, bubble_fraction=0.1,
             device="h100", memory_limit=80 * 10**9, link="nvlink", microbatch_size=2, allreduce_time=1e-3,
             rank_memory=(2 * 10**9, 10**9), replicas=(2, 1), equal_step_time=0.045, replica_order="own")
    assert str(p) == GOLDEN
    assert Plan.from_json(p.to_json()) == p
    old = p.to_json().replace('"replicas": [2, 1], ', "").replace('"equal_step_time": 0.045, ', "")
    old = old.replace('"replica_order": "own", ', "")
    assert Plan.from_json(old).replicas == (1, 1) and Plan.from_json(old).world_size == 4  # plans made before


@pytest.mark.parametrize("bad, match", [
    ((2, 0), "one int >= 1 per pipeline stage"), ("two", "None, 'auto' or one count"), (3, "None, 'auto'"),
    ((2, 2, 1), "use 5 ranks per pipeline replica, which does not divide world_size=3"),
])
def test_bad_replicas_name_the_fix(bad: object, match: str) -> None:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    with pytest.raises(PlanError, match=match):
        engine.plan(models.loss_fn, params, *batch, world_size=3, replicas=bad, microbatches=4)


def test_replicas_that_do_not_fit_the_other_counts_name_the_fix() -> None:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    with pytest.raises(PlanError, match=r"microbatches=3 must be a multiple of 2"):
        engine.plan(models.loss_fn, params, *batch, world_size=3, replicas=(2, 1), microbatches=3)
    with pytest.raises(PlanError, match=r"stages=3 but replicas=\(2, 1\) name 2 pipeline stages"):
        engine.plan(models.loss_fn, params, *batch, world_size=3, replicas=(2, 1), stages=3, microbatches=4)
    with pytest.raises(PlanError, match=r"replicas=\(2, 1\) x dp=2 make 6 ranks, the world has 3"):
        engine.plan(models.loss_fn, params, *batch, world_size=3, replicas=(2, 1), dp=2, microbatches=4)
    with pytest.raises(PlanError, match="do not split evenly over replicas"):
        attrs.evolve(_plan("1f1b", 2, (2, 1), (), 1, 4, "split"), microbatches=3)


def test_parallelize_refuses_bad_replicas_before_it_plans() -> None:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    with pytest.raises(PlanError, match="one int >= 1 per pipeline stage"):
        engine.parallelize(models.loss_fn, params, *batch, replicas=(1, -1))
    with pytest.raises(PlanError, match="does not divide world_size=1"):  # one process: no room for 2 + 1 ranks
        engine.parallelize(models.loss_fn, params, *batch, replicas=(2, 1), microbatches=4)


# -- engine.testing --------------------------------------------------------------------------------------------

@settings(max_examples=12)
@given(spec=engine.testing.plans(world_sizes=(3, 4), batch_size=24, num_eqns=28, replicas=True, cuts="drawn"))
def test_the_harness_draws_and_checks_unequal_replicas(spec) -> None:
    """`plans(replicas=True)`: hand-made plans with unequal replicas, every schedule, checked in process."""
    params, batch = models.init_params(layers=4), models.batch(size=24)
    result = engine.testing.assert_parallel_equivalent(models.loss_fn, params, *batch, plan=spec)
    assert result.plan.world_size == spec.world_size and result.max_rel_error <= 1e-10
    if spec.replicas is not None:
        assert result.plan.replicas == spec.replicas and sum(spec.replicas) * spec.dp in (3, 4)


@given(ranks=st.integers(1, 8), data=st.data())
def test_replica_counts_are_unequal_compositions(ranks: int, data) -> None:
    counts = data.draw(replica_counts(ranks))
    assert counts is None or (sum(counts) == ranks and len(set(counts)) > 1 and min(counts) >= 1
                              and 2 <= len(counts) < ranks)


def test_apportion_gives_each_spare_rank_to_the_slowest_per_replica() -> None:
    from engine.planning.replicas import apportion

    assert apportion((4.0, 1.0, 1.0), 4) == (2, 1, 1)
    assert apportion((4.0, 1.0, 1.0), 6) == (4, 1, 1)  # 4/4 = 1 = the others: the slowest is no slower than 1
    assert apportion((1.0, 3.0), 4) == (1, 3) and apportion((1.0, 1.0), 4) == (2, 2) and apportion((5.0,), 3) == (3,)


def test_user_cuts_run_with_replicas() -> None:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    p = engine.plan(models.loss_fn, params, *batch, world_size=3, replicas=(1, 2), microbatches=4, cuts=[7])
    assert p.cuts == (7,) and p.replicas == (1, 2) and p.world_size == 3
    result = run_steps(build_steps(models.loss_fn, params, batch, p), params, batch)
    ref = torch.func.grad(models.loss_fn)(params, *batch)
    for got, want in zip(pytree.tree_leaves(result.grads), pytree.tree_leaves(ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_schedule_auto_keeps_the_users_replicas() -> None:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    p = engine.plan(models.loss_fn, params, *batch, world_size=3, replicas=(2, 1), microbatches=4, schedule="auto")
    assert p.replicas == (2, 1) and p.world_size == 3 and p.considered
