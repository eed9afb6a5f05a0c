"""Misuse raises the engine's own errors with the numbers and the fix, never an assert or a hang."""
from __future__ import annotations

import datetime
import sys
from typing import Any

import attrs
import pytest
import torch

import engine
from tests.engine.ranks import on_threads
import ir
import schedules
from engine import PlanError, RuntimeMismatchError, SplitError
from engine.execution.inprocess import build_steps
from engine.planning.plan import Plan, StagePlan
from engine.planning.search import plan
from engine.execution.step import Step
from engine.execution.transport import Hub, LocalTransport
from tests.mpi import models

PARAMS = models.init_params(layers=4)
BATCH = models.batch(size=16)


def by_hand(schedule: str, stages: int, *, microbatches: int = 2, cuts: tuple[int, ...] = (14,)) -> Plan:
    return Plan(schedule, stages, stages, 1, microbatches, cuts,
                stages=tuple(StagePlan(k, 0, 0, 0) for k in range(stages)))


@pytest.fixture(scope="module")
def step() -> engine.Step:
    """One process, one rank: the step that the params and batch checks run against."""
    return engine.parallelize(models.loss_fn, PARAMS, *BATCH, microbatches=4)


# -- batch, world and layout ---------------------------------------------------------------------------

def test_batch_not_divisible_by_microbatches_times_dp() -> None:
    with pytest.raises(PlanError) as caught:
        plan(models.loss_fn, PARAMS, *BATCH, world_size=4, dp=2, microbatches=3)
    msg = str(caught.value)
    assert "batch size 16" in msg and "microbatches=3" in msg and "dp=2" in msg
    assert "dp 2: [1, 2, 4, 8]" in msg  # the valid microbatch counts: the fix
    with pytest.raises(PlanError, match=r"batch size 16 .*\(microbatches=5, dp=None, world_size=1.*\[1, 2, 4, 8, 16\]"):
        engine.parallelize(models.loss_fn, PARAMS, *BATCH, microbatches=5)


def test_batch_at_call_time_must_have_the_planned_rows(step: engine.Step) -> None:
    with pytest.raises(engine.InputError) as caught:
        step(step.shard(PARAMS), *models.batch(size=10))
    assert str(caught.value) == ("batch leaf 'tokens' is i64[10,3], the step was planned for i64[16,3]; pass "
                                 "batches of 16 rows (4 microbatches of 4 rows), or call engine.parallelize again "
                                 "with an example batch of 10 rows")


@pytest.mark.parametrize("world,stages,dp,valid", [
    (4, 3, None, "[1, 2, 4]"),
    (4, 2, 1, "[1, 2, 4]"),
    (6, 4, None, "[1, 2, 3, 6]"),
])
def test_world_size_must_equal_stages_times_dp(world: int, stages: int, dp: int | None, valid: str) -> None:
    with pytest.raises(PlanError) as caught:
        plan(models.loss_fn, PARAMS, *BATCH, world_size=world, stages=stages, dp=dp)
    msg = str(caught.value)
    assert f"stages={stages}, dp={dp}" in msg and f"world_size={world}" in msg
    assert f"valid stage counts are {valid}" in msg


def test_one_process_cannot_hold_two_stages_of_a_one_stage_per_rank_schedule() -> None:
    with pytest.raises(PlanError, match=r"stages=2, dp=None do not fit world_size=1.*valid stage counts are \[1\]"):
        engine.parallelize(models.loss_fn, PARAMS, *BATCH, schedule="1f1b", stages=2, microbatches=4)


def test_zbv_needs_an_even_stage_count() -> None:
    with pytest.raises(PlanError, match=r"stages=3 does not split into 2 stages per rank; use a multiple of 2"):
        plan(models.loss_fn, PARAMS, *BATCH, world_size=2, schedule="zbv", stages=3)
    with pytest.raises(schedules.ScheduleError, match=r"num_stages must be even \(got 3\); use 2 or 4"):
        schedules.get("zbv")(3, 4)


def test_interleaved_needs_microbatches_in_groups_of_the_ranks() -> None:
    with pytest.raises((PlanError, SplitError)) as caught:
        plan(models.loss_fn, PARAMS, *models.batch(size=12), world_size=2, schedule="interleaved-1f1b", stages=4,
             stages_per_rank=2, microbatches=3)
    msg = str(caught.value)
    assert "num_microbatches=3 is not a multiple of the 2 ranks" in msg and "use 2 or 4" in msg


def test_one_stage_per_rank_schedule_refuses_stages_per_rank() -> None:
    with pytest.raises(PlanError, match=r"'1f1b' runs one stage per rank; stages_per_rank=2 needs one of "
                                        r"\['dualpipev', 'interleaved-1f1b', 'interleaved-zb', 'looped-bfs', 'zbv'\]"):
        plan(models.loss_fn, PARAMS, *BATCH, world_size=2, schedule="1f1b", stages=4, stages_per_rank=2)


def test_more_stages_than_the_model_has_cut_points() -> None:
    with pytest.raises(SplitError) as caught:
        plan(models.loss_fn, PARAMS, *models.batch(size=64), world_size=64, stages=64, microbatches=1)
    msg = str(caught.value)
    assert "28 blocks" in msg and "fewer than 64 stages" in msg and "use at most 28 stages" in msg


# -- names, tracing, params ----------------------------------------------------------------------------

def test_unknown_schedule_suggests_the_closest_name() -> None:
    with pytest.raises(PlanError) as caught:
        engine.parallelize(models.loss_fn, PARAMS, *BATCH, schedule="zb-h2", microbatches=4)
    msg = str(caught.value)
    assert "unknown schedule 'zb-h2'" in msg and "did you mean 'zb-h1'?" in msg
    assert "1f1b, dualpipev, gpipe, interleaved-1f1b, interleaved-zb, looped-bfs, zb-h1, zbv" in msg
    with pytest.raises(PlanError, match=r"unknown schedule '1fb1'.*'1f1b'"):
        plan(models.loss_fn, PARAMS, *BATCH, world_size=2, schedule="1fb1")


def test_data_dependent_control_flow_cannot_be_traced() -> None:
    def branchy(params: dict, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = models.loss_fn(params, tokens, targets)
        return loss if loss > 1 else 2 * loss

    with pytest.raises(ir.TraceError) as caught:
        engine.parallelize(branchy, PARAMS, *BATCH, microbatches=4)
    msg = str(caught.value)
    assert "cannot trace branchy: Python reads a tensor's value" in msg and "torch.where" in msg
    assert "return loss if loss > 1 else 2 * loss" in msg  # the line


@pytest.mark.parametrize("entry", ["parallelize", "plan"])
def test_a_module_for_a_function_points_to_functionalize(entry: str) -> None:
    model = torch.nn.Linear(8, 8)
    with pytest.raises(engine.ModuleError) as caught:
        getattr(engine, entry)(model, PARAMS, *BATCH, microbatches=4)
    msg = str(caught.value)
    assert msg.startswith(f"engine.{entry} takes a pure function fn(params, *batch) -> loss and its params, "
                          "not an nn.Module (Linear)")
    assert "fn, variables = engine.functionalize(model, loss=F.cross_entropy)" in msg
    assert f"engine.{entry}(fn, variables, x, y, ...)" in msg
    assert "control flow" not in msg and "tensor's value" not in msg


@pytest.mark.parametrize("leaf,bad,got", [
    ("skip", torch.zeros(8, 9, dtype=torch.float64), "f64[8,9]"),
    ("skip", torch.zeros(8, 8, dtype=torch.float32), "f32[8,8]"),
    ("embed", None, "None"),
])
def test_param_leaf_of_the_wrong_shape_dtype_or_missing(step: engine.Step, leaf: str, bad: Any, got: str) -> None:
    params = step.shard(PARAMS)
    params[leaf] = bad
    with pytest.raises(PlanError) as caught:
        step(params, *BATCH)
    want = {"skip": "f64[8,8]", "embed": "f64[11,8]"}[leaf]
    assert f"param '{leaf}' on rank 0 should be {want}, got {got}; pass the tree from step.shard(params)" \
        == str(caught.value)


def test_params_tree_with_the_wrong_leaf_count(step: engine.Step) -> None:
    with pytest.raises(engine.InputError, match=r"params has 1 leaves, the traced function 14 \(missing "
                                                r"'layers.0.w', 'layers.0.b', 'layers.0.ln', 'layers.1.w' ...\); "
                                                r"pass the tree returned by step.shard\(params\)"):
        step({"embed": PARAMS["embed"]}, *BATCH)


# -- ranks that disagree -------------------------------------------------------------------------------

def verify_all(steps: list[Step]) -> list[BaseException | None]:
    """Every rank's `verify` at once, in threads sharing one hub (as ranks would over the network)."""
    hub = Hub(len(steps), timeout=30.0)
    mixed = [Step(s.planned, s.world, LocalTransport(hub, r), program=s.program) for r, s in enumerate(steps)]
    out = on_threads(len(mixed), lambda r: mixed[r].verify(), timeout=60)
    return [x if isinstance(x, BaseException) else None for x in out]


@pytest.fixture(scope="module")
def two_plans() -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    return (build_steps(models.loss_fn, PARAMS, BATCH, by_hand("1f1b", 2)),
            build_steps(models.loss_fn, PARAMS, BATCH, by_hand("gpipe", 2)))


def test_ranks_with_the_same_plan_agree(two_plans) -> None:
    ones, _ = two_plans
    assert verify_all(list(ones)) == [None, None]


def test_ranks_with_different_plans_refuse_to_run(two_plans) -> None:
    ones, gpipes = two_plans
    errors = verify_all([ones[0], gpipes[1]])
    for err in errors:  # both ranks refuse, so neither waits forever on the other's first message
        assert isinstance(err, RuntimeMismatchError), errors
        msg = str(err)
        assert "ranks [1] built a different plan (schedule) and schedule table than rank 0" in msg
        assert "every rank must call parallelize with the same function, shapes, dtypes and options" in msg


def test_ranks_with_the_same_plan_but_a_different_program_refuse_to_run(two_plans) -> None:
    ones, _ = two_plans
    odd = ones[1]
    edited = attrs.evolve(odd.program, instrs=odd.program.instrs[:-1])  # rank 1's program lost its last instruction
    bad = Step(odd.planned, odd.world, odd.transport, program=edited)
    errors = verify_all([ones[0], bad])
    assert all(isinstance(e, RuntimeMismatchError) and "the ranks' programs do not fit together: ranks [0] and [1] "
               "join the sums of group [0, 1] differently" in str(e) for e in errors), errors


def test_ranks_whose_transfers_do_not_meet_refuse_to_run(two_plans) -> None:
    """Each rank emits only its own program; they still check each other's: a send no receive meets."""
    ones, _ = two_plans
    odd = ones[0]
    comms = [k for k, ins in enumerate(odd.program.instrs) if ins.kind == "comm"]
    edited = attrs.evolve(odd.program, instrs=tuple(ins for k, ins in enumerate(odd.program.instrs) if k != comms[0]))
    errors = verify_all([Step(odd.planned, odd.world, odd.transport, program=edited), ones[1]])
    assert all(isinstance(e, RuntimeMismatchError) and "does not receive" in str(e) for e in errors), errors


def test_mpirun_without_mpi4py_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPI is an extra: a job started by mpirun in an environment without mpi4py is told how to get it."""
    from engine.execution import launch

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `import mpi4py` raises ImportError
    with pytest.raises(ImportError, match=r"started by mpirun .* pip install 'fnpipe\[mpi\]'.* or launch with "
                                          r"torchrun instead"):
        launch._init_from_mpi(datetime.timedelta(seconds=5))


def test_a_device_index_is_no_disagreement_between_ranks() -> None:
    """RoPE's `arange(..., device=x.device)` prints `device=cuda:1` in rank 1's graph (the Llama rows of the
    2 x H200 benchmark refused to run until the fingerprint left device indices out); another device type is."""
    from ir.device import rank_neutral

    def f(p: dict, x: torch.Tensor) -> torch.Tensor:
        return (p["w"] * x + torch.arange(x.shape[0], device=x.device, dtype=x.dtype)).sum()

    text = str(ir.trace(f, {"w": torch.ones(3)}, torch.ones(3)))
    assert "device=cpu" in text
    on = {d: rank_neutral(text.replace("device=cpu", f"device={d}")) for d in ("cuda:0", "cuda:1", "cuda:12", "cpu")}
    assert on["cuda:0"] == on["cuda:1"] == on["cuda:12"] != on["cpu"]
    assert "device=cuda " in on["cuda:1"]


def test_plans_of_ranks_on_other_device_indices_are_equal() -> None:
    """The graph hash a plan records and the calibration signatures its costs are looked up by are the same for
    a graph on cuda:0 and on cuda:1 (found on 2 x H200: the Llama and ResNet plans differed in graph_hash)."""
    from engine.planning.calibration import signature
    from engine.planning.op_costs import graph_hash
    from ir.device import retarget

    def f(p: dict, x: torch.Tensor) -> torch.Tensor:
        return (p["w"] * x + torch.arange(x.shape[0], device=x.device, dtype=x.dtype)).sum()

    g = ir.trace(f, {"w": torch.ones(3)}, torch.ones(3))
    zero, one = retarget(g, "cpu", "cuda:0"), retarget(g, "cpu", "cuda:1")
    assert "cuda:1" in str(one) and str(zero) != str(one)
    assert graph_hash(zero) == graph_hash(one) != graph_hash(g)
    assert [signature(e) for e in zero.eqns] == [signature(e) for e in one.eqns]
