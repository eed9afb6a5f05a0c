"""Per-rank programs: the listing, the JSON round trip, buffer lifetimes, and 1F1B's analytic memory."""
from __future__ import annotations

import functools

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ir
import schedules
from engine import Plan, Program
from engine.execution.emit import StageInfo
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.plan import StagePlan
from engine.execution.assemble import assemble
from engine.planning.artifacts import Planned, lowered_table, stage_programs
from tests.mpi import models

ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb-h1")
TWO_STAGES_PER_RANK = ("zbv", "interleaved-1f1b")


def tiny_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def by_hand(schedule: str, stages: int, depth: int, *, microbatches: int, dp: int = 1,
            cuts: tuple[int, ...] = ()) -> Plan:
    options = (("stages_per_rank", stages // depth),) if schedule == "interleaved-1f1b" else ()
    return Plan(schedule, stages, depth, dp, microbatches, cuts,
                stages=tuple(StagePlan(k, 0, 0, 0) for k in range(stages)), schedule_options=options)


# -- the listing ---------------------------------------------------------------------------------------

GOLDEN_RANK0 = """\
program rank 0 (10 instructions)
     0: forward s0 mb0 [p0 x2] -> [b0]
     1: comm { send_act s0 mb0 to r1 [b0] }
     2: forward s0 mb1 [p0 x2] -> [b1]
     3: comm { send_act s0 mb1 to r1 [b1]; recv_grad s0 mb0 from r1 [b2] }
     4: backward s0 mb0 [x2 b2 b0] -> [g0]
     5: free [b0 b2]
     6: comm { recv_grad s0 mb1 from r1 [b3] }
     7: backward s0 mb1 [x2 b3 b1] -> [g0]
     8: free [b1 b3]
     9: reduce_loss []"""

GOLDEN_RANK1 = """\
program rank 1 (18 instructions)
     0: comm { recv_act s1 mb0 from r0 [b0] }
     1: forward s1 mb0 [p1 x3 b0] -> [b1 b2]
     2: add_loss s1 mb0 [b1]
     3: free [b1]
     4: loss_grad s1 mb0 [] -> [b3]
     5: backward s1 mb0 [p1 b0 b3 b2] -> [b4 g1]
     6: free [b0 b2 b3]
     7: comm { recv_act s1 mb1 from r0 [b5]; send_grad s1 mb0 to r0 [b4] }
     8: free [b4]
     9: forward s1 mb1 [p1 x3 b5] -> [b6 b7]
    10: add_loss s1 mb1 [b6]
    11: free [b6]
    12: loss_grad s1 mb1 [] -> [b8]
    13: backward s1 mb1 [p1 b5 b8 b7] -> [b9 g1]
    14: free [b5 b7 b8]
    15: comm { send_grad s1 mb1 to r0 [b9] }
    16: free [b9]
    17: reduce_loss []"""


def test_program_listing_of_a_two_stage_1f1b() -> None:
    """x @ w1 -> tanh | @ w2 - y -> square -> mean, cut after tanh; 2 microbatches of 2 rows."""
    params = {"w1": torch.ones(3, 4, dtype=torch.float64), "w2": torch.ones(4, 2, dtype=torch.float64)}
    batch = (torch.ones(4, 3, dtype=torch.float64), torch.zeros(4, 2, dtype=torch.float64))
    steps = build_steps(tiny_loss, params, batch, by_hand("1f1b", 2, 2, microbatches=2, cuts=(2,)))
    assert str(steps[0].program) == GOLDEN_RANK0
    assert str(steps[1].program) == GOLDEN_RANK1


# -- every layout's programs ---------------------------------------------------------------------------

@functools.cache
def graph() -> ir.Graph:
    """The tied-embedding, skip-connection model of the multi-process tests, one microbatch of 2 rows."""
    return ir.trace(models.loss_fn, models.init_params(layers=4), *models.batch(size=2), device="cpu")


@functools.cache
def infos(num_stages: int) -> tuple[StageInfo, ...]:
    n = len(graph().eqns)
    cuts = tuple(round(n * k / num_stages) for k in range(1, num_stages))
    return stage_programs(graph(), cuts, device="cpu")


def programs(schedule: str, depth: int, microbatches: int, dp: int = 1) -> list[Program]:
    stages = depth * (2 if schedule in TWO_STAGES_PER_RANK else 1)
    si = infos(stages)
    plan = by_hand(schedule, stages, depth, microbatches=microbatches, dp=dp,
                   cuts=tuple(s.stage.start for s in si[1:]))
    return build_programs(si, plan)[1]


def build_programs(si: tuple[StageInfo, ...], plan: Plan) -> tuple[schedules.Table, list[Program]]:
    """The plan's lowered table and every rank's program, each assembled as a rank assembles its own."""
    planned = Planned(plan, graph(), si, lowered_table(plan))
    return planned.table, [assemble(planned, r) for r in range(plan.world_size)]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[str, int, int, int]:
    """(schedule, pipeline depth, microbatches, dp) that the schedule can run."""
    schedule = draw(st.sampled_from(ONE_STAGE_PER_RANK + TWO_STAGES_PER_RANK))
    depth = draw(st.sampled_from([1, 2, 3, 4]))
    if schedule == "interleaved-1f1b":  # microbatches go round in groups of the ranks
        m = depth * draw(st.integers(1, 3))
    else:
        m = draw(st.integers(1, 8))
    return schedule, depth, m, draw(st.sampled_from([1, 2]))


def buffer_events(ins) -> tuple[list[str], list[str]]:
    """(refs read, refs written) by one instruction, comm sends and receives included."""
    if ins.kind == "comm":
        return ([b for c in ins.comm if c.op == "send" for b in c.bufs],
                [b for c in ins.comm if c.op == "recv" for b in c.bufs])
    return list(ins.reads), list(ins.writes)


def check_lifetimes(prog: Program) -> int:
    """Every buffer is written before it is read, freed exactly once, never touched after its free; returns
    how many buffers the program uses."""
    written: set[str] = set()
    freed: dict[str, int] = {}
    for i, ins in enumerate(prog.instrs):
        if ins.kind == "free":
            for ref in ins.reads:
                assert ref.startswith("b"), f"rank {prog.rank} @{i}: free of {ref}, which is not a buffer"
                assert ref in written, f"rank {prog.rank} @{i}: {ref} freed but never written"
                assert ref not in freed, f"rank {prog.rank} @{i}: {ref} freed twice (first @{freed[ref]})"
                freed[ref] = i
            continue
        reads, writes = buffer_events(ins)
        for ref in reads + writes:
            assert ref not in freed, f"rank {prog.rank} @{i}: {ins} touches {ref} after its free @{freed[ref]}"
        for ref in reads:
            assert not ref.startswith("b") or ref in written, f"rank {prog.rank} @{i}: {ins} reads {ref} unwritten"
            assert ref[0] in "bpxg", ref
        for ref in writes:
            assert ref[0] in "bg", f"rank {prog.rank} @{i}: {ins} writes {ref}"
        written.update(r for r in writes if r.startswith("b"))
    assert set(freed) == written, f"rank {prog.rank}: never freed {sorted(written - set(freed))}"
    return len(written)


@settings(max_examples=60)
@given(layouts())
def test_every_buffer_is_freed_exactly_once_and_never_used_after(layout: tuple[str, int, int, int]) -> None:
    schedule, depth, m, dp = layout
    progs = programs(schedule, depth, m, dp)
    assert [p.rank for p in progs] == list(range(depth * dp))
    used = [check_lifetimes(p) for p in progs]
    assert sum(used) > 0


@settings(max_examples=30)
@given(layouts())
def test_programs_round_trip_through_json(layout: tuple[str, int, int, int]) -> None:
    for prog in programs(*layout):
        text = prog.to_json()
        back = Program.from_json(text)
        assert back == prog and back.to_json() == text and str(back) == str(prog)


def test_plan_round_trips_through_json() -> None:
    p = by_hand("interleaved-1f1b", 4, 2, microbatches=4, dp=2, cuts=(7, 14, 21))
    assert Plan.from_json(p.to_json()) == p


# -- 1F1B frees activations at last use ----------------------------------------------------------------

def live_samples(prog: Program) -> list[tuple[int, int]]:
    """(microbatches with a live buffer, live buffers) after each instruction and the frees that follow it:
    what the executor holds between instructions. (Inside one comm group a finished microbatch's outgoing
    grad and the next one's incoming activation coexist; that is a transfer, not a stash: not counted.)"""
    owner: dict[str, int] = {}
    samples = []
    instrs = prog.instrs
    for i, ins in enumerate(instrs):
        if ins.kind == "free":
            for ref in ins.reads:
                del owner[ref]
        elif ins.kind == "comm":
            owner.update({b: c.mb for c in ins.comm if c.op == "recv" for b in c.bufs})
        else:
            owner.update({b: ins.mb for b in ins.writes if b.startswith("b")})
        if i + 1 == len(instrs) or instrs[i + 1].kind != "free":
            samples.append((len(set(owner.values())), len(owner)))
    return samples


def live_between_instructions(prog: Program) -> tuple[int, int]:
    """(peak microbatches with a live buffer, peak live buffers)."""
    samples = live_samples(prog)
    return max(m for m, _ in samples), max(b for _, b in samples)


@pytest.mark.parametrize("depth,m", [(2, 8), (4, 8), (4, 3), (3, 2)])
def test_peak_live_microbatches_match_the_analytic_counts(depth: int, m: int) -> None:
    """1F1B keeps min(m, p - r) microbatches alive on rank r, GPipe all m (DESIGN.md's table)."""
    one = [live_between_instructions(p)[0] for p in programs("1f1b", depth, m)]
    gp = [live_between_instructions(p)[0] for p in programs("gpipe", depth, m)]
    assert one == [min(m, depth - r) for r in range(depth)]
    assert gp == [m] * depth


def test_1f1b_holds_fewer_buffers_than_gpipe() -> None:
    one = live_between_instructions(programs("1f1b", 4, 8)[0])
    gp = live_between_instructions(programs("gpipe", 4, 8)[0])
    assert (one[0], gp[0]) == (4, 8)
    assert one[1] < gp[1], (one, gp)


def test_the_schedules_agree_on_what_the_table_says() -> None:
    """The program of each rank runs exactly the compute of its row of the lowered table."""
    for schedule in ONE_STAGE_PER_RANK + TWO_STAGES_PER_RANK:
        stages = 4 if schedule in TWO_STAGES_PER_RANK else 2
        si = infos(stages)
        plan = by_hand(schedule, stages, 2, microbatches=4, cuts=tuple(s.stage.start for s in si[1:]))
        table, progs = build_programs(si, plan)
        for rank, prog in enumerate(progs):
            forwards = [(a.stage, a.microbatch) for a in table.rows[rank] if a.kind == "F"]
            assert [(i.stage, i.mb) for i in prog.instrs if i.kind == "forward"] == forwards, schedule
            assert sum(i.kind == "add_loss" for i in prog.instrs) == (4 if table.rank_of(stages - 1) == rank else 0)
            assert prog.instrs[-1].kind == "reduce_loss"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zbv"])
def test_the_runtime_holds_what_the_program_says(schedule: str) -> None:
    """The executor's buffer dict, seen before every instruction, is exactly the program's live set."""
    seen: dict[int, list[int]] = {0: [], 1: []}

    def hook(executor, ins) -> None:
        if ins.kind != "free":
            seen[executor.program.rank].append(len(executor.bufs))

    stages = 4 if schedule in TWO_STAGES_PER_RANK else 2
    plan = by_hand(schedule, stages, 2, microbatches=4, cuts=tuple(s.stage.start for s in infos(stages)[1:]))
    params, batch = models.init_params(layers=4), models.batch(size=8)
    result = run_steps(build_steps(models.loss_fn, params, batch, plan, hook=hook), params, batch)
    for rank, step in enumerate(result.steps):
        static = [b for _, b in live_samples(step.program)]
        assert seen[rank] == [0] + static[:-1] and static[-1] == 0, rank
        assert step.executor.bufs == {} and step.executor.pending == {}  # nothing outlives the step
    assert max(seen[0]) > 0


def test_the_lifetime_check_can_fail() -> None:
    prog = programs("1f1b", 2, 2)[1]
    k = next(i for i, ins in enumerate(prog.instrs) if ins.kind == "free")
    leak = attrs.evolve(prog, instrs=prog.instrs[:k] + prog.instrs[k + 1:])
    with pytest.raises(AssertionError, match="never freed"):
        check_lifetimes(leak)
    early = attrs.evolve(prog, instrs=prog.instrs[:k - 1] + (prog.instrs[k], prog.instrs[k - 1]) + prog.instrs[k + 1:])
    with pytest.raises(AssertionError, match="after its free"):
        check_lifetimes(early)
