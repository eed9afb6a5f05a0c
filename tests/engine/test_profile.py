"""engine.execution.profile: the stage programs measured as they run, and the step predicted from them."""
from __future__ import annotations

import attrs
import pytest
import torch

import engine
from engine.execution.assemble import assemble
from engine.execution.footprint import footprint
from engine.execution.inprocess import build_steps, run_each, run_steps
from engine.execution.profile import KIND, Profile, ProgramCost, against_plan, compute_only, first_instructions, \
    gather, predicted_step_time
from engine.planning.search import search
from tests.engine.test_footprint import _mlp

LAYOUTS = [("1f1b", {}), ("gpipe", {}), ("zb-h1", {}), ("interleaved-1f1b", {"stages_per_rank": 2}),
           ("zbv", {}), ("interleaved-zb", {"stages_per_rank": 2}), ("dualpipev", {}), ("looped-bfs", {"stages_per_rank": 2})]


def _planned(schedule: str, layout: dict, world: int = 2, dp: int = 1):  # type: ignore[no-untyped-def]
    fn, params, x, y = _mlp()
    return search(fn, params, x, y, world_size=world, schedule=schedule, microbatches=4, device="cpu", dp=dp,
                  **layout)


def _plans_own_times(planned) -> Profile:  # type: ignore[no-untyped-def]
    """A profile that says every program takes what the planner costed it at (BW = B + W)."""
    st = planned.plan.stages
    seconds = {"forward": lambda s: st[s].forward_time, "backward_input": lambda s: st[s].backward_input_time,
               "backward_weight": lambda s: st[s].backward_weight_time,
               "backward": lambda s: st[s].backward_input_time + st[s].backward_weight_time}
    keys = {k for r in range(planned.plan.world_size) for k in first_instructions(assemble(planned, r))}
    return Profile(ProgramCost(s, kind, acc, seconds=seconds[kind](s), peak_bytes=None) for s, kind, acc in keys)


@pytest.mark.parametrize("schedule,layout", LAYOUTS)
def test_the_planners_own_times_predict_the_planners_step(schedule: str, layout: dict) -> None:
    """Simulated from a profile that holds the planner's F, B, W seconds, the step takes exactly the plan's
    predicted time: the program-based prediction runs the planner's simulation, only with other numbers."""
    planned = _planned(schedule, layout)
    programs = [assemble(planned, r) for r in range(planned.plan.world_size)]
    got = predicted_step_time(planned.plan, planned.table, programs, _plans_own_times(planned))
    assert got == pytest.approx(planned.plan.predicted_step_time, rel=1e-12)


def test_an_order_with_split_and_fused_backwards_on_one_stage_predicts_the_planners_step() -> None:
    """DeepSeek's DualPipeV order runs some backwards of a stage as B then W and others fused (BW): each
    action must cost what the planner costs it (a BW = B + W), not the backward twice."""
    import schedules

    fn, params, x, y = _mlp()
    build = schedules.get("dualpipev")
    planned = search(fn, params, x, y, world_size=2, schedule="dualpipev", microbatches=4, device="cpu",
                     build=lambda n, m, **o: build(n, m))
    programs = [assemble(planned, r) for r in range(2)]
    kinds: dict[int, set[str]] = {}
    for ins in (i for p in programs for i in p.instrs if i.kind in ("backward_input", "backward")):
        kinds.setdefault(ins.stage, set()).add(ins.kind)
    assert any(len(k) == 2 for k in kinds.values()), kinds  # the case under test is there
    got = predicted_step_time(planned.plan, planned.table, programs, _plans_own_times(planned))
    assert got == pytest.approx(planned.plan.predicted_step_time, rel=1e-12)


def test_with_data_parallel_the_all_reduce_is_added() -> None:
    planned = _planned("1f1b", {}, world=4, dp=2)
    assert planned.plan.allreduce_time > 0
    programs = [assemble(planned, r) for r in range(4)]
    got = predicted_step_time(planned.plan, planned.table, programs, _plans_own_times(planned))
    assert got == pytest.approx(planned.plan.predicted_step_time, rel=1e-12)


def test_a_slower_stage_slows_the_predicted_step_by_its_share() -> None:
    """Doubling stage 1's measured programs on a 1f1b pipeline of two stages: the step grows by at least
    stage 1's extra busy time (it is the slower rank then) and is never faster."""
    planned = _planned("1f1b", {})
    programs = [assemble(planned, r) for r in range(2)]
    base = _plans_own_times(planned)
    slow = Profile(attrs.evolve(p, seconds=2 * p.seconds) if p.stage == 1 else p for p in base.programs)
    t0 = predicted_step_time(planned.plan, planned.table, programs, base)
    t1 = predicted_step_time(planned.plan, planned.table, programs, slow)
    st = planned.plan.stages[1]
    extra = 4 * (st.forward_time + st.backward_input_time + st.backward_weight_time)  # 4 microbatches
    assert t1 >= t0 + extra * 0.999


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_against_plan_shows_each_stages_measured_over_planned(schedule: str) -> None:
    """The per-stage table: the planner's own times read 1.00 everywhere; stage 1's programs made twice as
    slow read 2.00 on stage 1 only, for fused BW (1f1b) and split B, W (zb-h1) alike."""
    planned = _planned(schedule, {})
    programs = [assemble(planned, r) for r in range(2)]
    base = _plans_own_times(planned)
    slow = Profile(attrs.evolve(p, seconds=2 * p.seconds) if p.stage == 1 else p for p in base.programs)
    rows = [line.split() for line in against_plan(planned.plan, programs, slow).splitlines()[1:]]
    assert [(r[0], r[3], r[6]) for r in rows] == [("0", "1.00", "1.00"), ("1", "2.00", "2.00")]
    st = planned.plan.stages[1]
    assert float(rows[1][2]) == pytest.approx(2 * st.forward_time * 1e3, abs=0.006)
    assert float(rows[1][5]) == pytest.approx(2 * (st.backward_input_time + st.backward_weight_time) * 1e3, abs=0.006)
    part = Profile(p for p in base.programs if p.stage != 1)
    assert against_plan(planned.plan, programs, part) is None


def test_a_program_not_measured_gives_no_prediction() -> None:
    planned = _planned("zb-h1", {})
    programs = [assemble(planned, r) for r in range(2)]
    full = _plans_own_times(planned)
    part = Profile(p for p in full.programs if not (p.stage == 1 and p.kind == "backward_weight"))
    assert predicted_step_time(planned.plan, planned.table, programs, part) is None


def test_compute_only_keeps_each_ranks_compute_order() -> None:
    planned = _planned("zbv", {})
    bare = compute_only(planned.table)
    assert not bare.is_lowered
    for lowered, row in zip(planned.table.rows, bare.rows):
        assert list(row) == [a for a in lowered if a.is_compute]


def test_measured_bytes_replace_fxs_in_the_replay() -> None:
    """A compute whose program was measured to make X bytes counts X, not fx's replay; unmeasured ones keep
    fx's: with every program measured 1 MiB above fx, the peak rises by exactly 1 MiB."""
    import ir

    planned = _planned("1f1b", {})
    program, infos, graph = assemble(planned, 0), planned.stages, planned.graph
    plain = footprint(program, infos, graph, microbatches=4)

    def more(key):  # type: ignore[no-untyped-def]
        stage, kind, acc = key
        return ir.run_bytes(getattr(infos[stage].ad, kind).graph, acc).peak + 2**20

    raised = footprint(program, infos, graph, microbatches=4, measured=more)
    assert raised.peak == plain.peak + 2**20
    assert footprint(program, infos, graph, microbatches=4, measured=lambda key: None) == plain


def test_every_rank_measures_its_programs_and_gets_everyones() -> None:
    """profile_programs on every rank of an in-process pipeline (the collective `parallelize` runs on CUDA):
    each distinct program of every rank measured once, with positive seconds (no allocator count on CPU);
    the prediction from them is a positive time, and the step still computes torch.func.grad's numbers."""
    fn, params, x, y = _mlp()
    plan = engine.plan(fn, params, x, y, world_size=2, schedule="zb-h1", microbatches=4)
    steps = build_steps(fn, params, (x, y), plan)
    profiles = run_each(steps, lambda step: step.profile_programs(x, y))
    want = {k for s in steps for k in first_instructions(s.program)}
    for prof in profiles:
        assert {p.key for p in prof.programs} == want
        assert all(p.seconds > 0 and p.peak_bytes is None for p in prof.programs)
        assert {p.kind for p in prof.programs} == {"forward", "backward_input", "backward_weight"}
    assert all(0 < s.predicted_step_time < 10 for s in steps)
    assert all(p.launch is None for prof in profiles for p in prof.programs)  # CPU: the host runs them
    assert all(len(s.posts) == 2 and all(0 < x < 1 for x in s.posts) and s.posts == steps[0].posts for s in steps)
    assert all(s.memory() == steps[0].memory() for s in steps)
    got = run_steps(steps, params, (x, y))
    ref, ref_loss = torch.func.grad_and_value(fn)(params, x, y)
    assert float(got.loss) == pytest.approx(float(ref_loss), rel=1e-6)
    for g, r in zip(torch.utils._pytree.tree_leaves(got.grads), torch.utils._pytree.tree_leaves(ref), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_gather_keeps_one_measurement_per_program() -> None:
    a = ProgramCost(0, "forward", (), seconds=1.0, peak_bytes=10)
    b = ProgramCost(0, "forward", (), seconds=2.0, peak_bytes=20)  # the same program on a dp replica
    c = ProgramCost(1, "backward", (0, 1), seconds=3.0, peak_bytes=30)
    got = gather([a], lambda mine: [mine, [attrs.asdict(b), attrs.asdict(c)]])
    assert got.programs == (a, c)
    assert Profile.from_json(got.to_json()) == got
    assert str(c) == "BW1 (+2 grads): 3000.00 ms, makes 30 B"
    assert set(KIND) == {"forward", "backward_input", "backward_weight", "backward"}


def test_a_rank_that_fails_to_load_its_programs_fails_every_rank_at_once() -> None:
    """One rank's compile raises: it raises its own error, and its peer is told at the gather that follows
    the compiles (RuntimeMismatchError naming the rank), not after the wait's bound."""
    fn, params, x, y = _mlp()
    plan = engine.plan(fn, params, x, y, world_size=2, schedule="1f1b", microbatches=4)
    steps = build_steps(fn, params, (x, y), plan)

    def broken(stages, *, batch=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("inductor: out of registers (stand-in)")

    steps[1].executor.warmup = broken  # type: ignore[method-assign]
    errors: list[BaseException | None] = [None, None]

    def work(step):  # type: ignore[no-untyped-def]
        try:
            step.profile_programs(x, y)
        except Exception as exc:  # noqa: BLE001
            errors[step.world.rank] = exc

    import time

    start = time.monotonic()
    run_each(steps, work)
    assert time.monotonic() - start < 10
    assert isinstance(errors[1], RuntimeError) and "out of registers" in str(errors[1])
    assert isinstance(errors[0], engine.RuntimeMismatchError), errors[0]
    assert "rank 1 failed to load (compile) its stage programs: RuntimeError: inductor: out of registers" in str(errors[0])


@pytest.mark.parametrize("text,expect", [(None, 1800.0), ("3600", 3600.0), ("5", 60.0)])
def test_the_wait_after_compiling_is_set_by_fnpipe_compile_wait(monkeypatch, text, expect) -> None:  # type: ignore[no-untyped-def]
    from engine.execution.transport import compile_wait

    if text is None:
        monkeypatch.delenv("FNPIPE_COMPILE_WAIT", raising=False)
    else:
        monkeypatch.setenv("FNPIPE_COMPILE_WAIT", text)
    assert compile_wait(60.0) == expect  # never shorter than the step's own timeout


@pytest.mark.parametrize("text", ["soon", "0", "-3"])
def test_a_bad_fnpipe_compile_wait_names_the_fix(monkeypatch, text) -> None:  # type: ignore[no-untyped-def]
    from engine.execution.transport import compile_wait

    monkeypatch.setenv("FNPIPE_COMPILE_WAIT", text)
    with pytest.raises(engine.PlanError, match="FNPIPE_COMPILE_WAIT=3600"):
        compile_wait(60.0)


def test_parallelize_refuses_a_bad_fnpipe_compile_wait_before_planning(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fn, params, x, y = _mlp()
    monkeypatch.setenv("FNPIPE_COMPILE_WAIT", "later")
    with pytest.raises(engine.PlanError, match="FNPIPE_COMPILE_WAIT='later'"):
        engine.parallelize(fn, params, x, y, schedule="1f1b", microbatches=4)


class ScriptedClock:
    """`in_turn`'s clock on a time the test moves by hand: each mark reads `t`."""

    def __init__(self) -> None:
        self.t, self.marks = 0.0, []

    def start(self) -> None:
        self.marks = []

    def mark(self) -> None:
        self.marks.append(self.t)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def test_each_program_is_charged_from_its_mark_to_the_next_in_turn_the_first_round_left_out() -> None:
    """`in_turn` on a scripted clock: three programs run in turn for 1 + 2 rounds; each is charged the median of
    its gaps in rounds 2 and 3 (round 1 starts from an idle device), in run order, every run run each round."""
    from engine.execution.profile import in_turn

    calls: list[str] = []

    clock = ScriptedClock()
    cost = {"F": [9.0, 2.0, 4.0], "B": [9.0, 3.0, 3.0], "W": [9.0, 1.0, 1.5]}  # per round: the first is cold

    def program(name: str):  # type: ignore[no-untyped-def]
        def run() -> None:
            clock.t += cost[name][sum(c == name for c in calls)]
            calls.append(name)
        return run

    got = in_turn([program("F"), program("B"), program("W")], clock, reps=2)  # type: ignore[arg-type]
    assert calls == ["F", "B", "W"] * 3
    assert got == pytest.approx([3.0, 3.0, 1.25])


def test_what_runs_between_programs_is_left_out_of_their_times() -> None:
    """`in_turn(..., between=flush)`: a cold-cache flush before every program, each program charged from its mark
    to the mark right after it, the flushes charged to nobody."""
    from engine.execution.profile import in_turn

    clock = ScriptedClock()
    order: list[str] = []

    def step(name: str, seconds: float):  # type: ignore[no-untyped-def]
        def run() -> None:
            clock.t += seconds
            order.append(name)
        return run

    got = in_turn([step("F", 2.0), step("B", 3.0)], clock, reps=2, between=step("flush", 100.0))  # type: ignore[arg-type]
    assert order == ["flush", "F", "flush", "B"] * 3
    assert got == pytest.approx([2.0, 3.0])


def test_settling_runs_the_programs_back_to_back_for_the_given_seconds_before_the_timed_rounds() -> None:
    """`in_turn(..., settle=s)`: one round timed to size the settling, then about `s` seconds of untimed rounds, then
    the timed rounds; a program that slows under sustained load (a GPU at its power cap) is charged its settled
    time, not its time fresh from idle."""
    from engine.execution.profile import in_turn

    clock = ScriptedClock()
    runs: list[str] = []

    def program(name: str, fresh: float, settled: float):  # type: ignore[no-untyped-def]
        def run() -> None:
            clock.t += fresh if len(runs) < 6 else settled  # the first three rounds run fresh from idle
            runs.append(name)
        return run

    fresh = in_turn([program("F", 1.0, 1.2), program("B", 2.0, 2.4)], clock, reps=2)  # type: ignore[arg-type]
    assert runs == ["F", "B"] * 3 and fresh == pytest.approx([1.0, 2.0])
    runs.clear()
    settled = in_turn([program("F", 1.0, 1.2), program("B", 2.0, 2.4)], clock, reps=2, settle=7.0)  # type: ignore[arg-type]
    assert len(runs) == 2 * (1 + 3 + 3)  # one round sizes the settling: 7 s / 3 s a round = 3 rounds, then 1 + 2
    assert settled == pytest.approx([1.2, 2.4])


@pytest.mark.parametrize("text,device,expect", [(None, "cpu", 0.0), (None, "cuda", 1.0), ("0", "cuda", 0.0),
                                                ("2", "cpu", 2.0), (" 0.25 ", "cuda", 0.25)])
def test_the_settling_time_is_set_by_fnpipe_profile_settle(monkeypatch, text, device, expect) -> None:  # type: ignore[no-untyped-def]
    from engine.planning.calibration import SETTLE_CUDA, settle_seconds

    assert SETTLE_CUDA == 1.0
    if text is None:
        monkeypatch.delenv("FNPIPE_PROFILE_SETTLE", raising=False)
    else:
        monkeypatch.setenv("FNPIPE_PROFILE_SETTLE", text)
    assert settle_seconds(torch.device(device)) == expect


@pytest.mark.parametrize("text", ["soon", "-1", "inf", "nan"])
def test_a_bad_fnpipe_profile_settle_is_refused_by_engine_init(monkeypatch, text) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FNPIPE_PROFILE_SETTLE", text)
    with pytest.raises(engine.PlanError, match="FNPIPE_PROFILE_SETTLE=.*a number >= 0"):
        engine.init()


def test_the_host_clock_times_runs_on_cpu() -> None:
    import time as time_mod

    from engine.execution.profile import Clock, in_turn

    got = in_turn([lambda: time_mod.sleep(0.02), lambda: time_mod.sleep(0.005)], Clock(torch.device("cpu")), 2)
    assert 0.019 < got[0] < 0.05 and 0.004 < got[1] < 0.02


def test_faster_of_two_measurements_keeps_each_programs_smaller_seconds_and_larger_bytes() -> None:
    from engine.execution.profile import faster_of

    a = Profile([ProgramCost(0, "forward", (), 2e-3, 100), ProgramCost(1, "backward", (3,), 5e-3, None),
                 ProgramCost(2, "forward", (), 1e-3, 7)])
    b = Profile([ProgramCost(0, "forward", (), 3e-3, 120), ProgramCost(1, "backward", (3,), 4e-3, 50),
                 ProgramCost(3, "forward", (), 9e-3, 1)])
    got = faster_of(a, b)
    assert [(c.key, c.seconds, c.peak_bytes) for c in got.programs] == [
        ((0, "forward", ()), 2e-3, 120), ((1, "backward", (3,)), 4e-3, 50), ((2, "forward", ()), 1e-3, 7),
        ((3, "forward", ()), 9e-3, 1)]
    assert faster_of(b, a) == got


def test_executor_measures_every_stage_twice_and_keeps_the_faster_time(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A stage timed while the device is still busy with what came before reads slow; the second pass over
    the stages does not, and each program keeps its faster time (and the larger of its byte counts)."""
    from engine.execution import executor as ex

    fn, params, x, y = _mlp()
    planned = _planned("zbv", {})
    steps = build_steps(fn, params, (x, y), planned.plan)
    run_steps(steps, params, (x, y))  # every program loaded
    step = steps[0]
    calls = []

    settles = []

    def timed(runs, device, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(runs))
        settles.append(kw.get("settle"))
        slow = 5.0 if len(calls) == 1 else 1.0  # the first stage of the first pass reads 5 x
        return tuple(ProgramCost(*key, seconds=slow * (1 + i) * 1e-3, peak_bytes=len(calls))
                     for i, (key, _) in enumerate(runs))

    monkeypatch.setattr(ex, "measure", timed)
    monkeypatch.setenv("FNPIPE_PROFILE_SETTLE", "0.8")
    costs = step.executor.measure(step.local_stages)
    stages = len(step.local_stages)
    assert stages == 2 and len(calls) == 2 * stages  # two passes over the rank's two stages
    assert settles == [0.8, 0.2] * 2  # each pass's first stage settles the device, the next keeps it busy
    for st in step.local_stages:  # each program at its unslowed seconds: (1 + its place in the stage) ms
        mine = sorted(round(c.seconds * 1e3, 9) for c in costs if c.stage == st)
        assert mine == [float(1 + i) for i in range(len(mine))] and mine
    first, second = step.local_stages
    assert {c.peak_bytes for c in costs if c.stage == first} == {stages + 1}  # the second pass's count
    assert {c.peak_bytes for c in costs if c.stage == second} == {2 * stages}


def _launched(profile: Profile, share: float) -> Profile:
    return Profile(attrs.evolve(p, launch=share * p.seconds) for p in profile.programs)


@pytest.mark.parametrize("schedule,layout", [("1f1b", {}), ("zb-h1", {}), ("zbv", {})])
def test_a_host_ahead_of_its_device_leaves_the_prediction_as_it_was(schedule: str, layout: dict) -> None:
    """Launches half of each program's time, posts free: each rank's host keeps ahead, the step is the device's."""
    planned = _planned(schedule, layout)
    programs = [assemble(planned, r) for r in range(2)]
    base = _plans_own_times(planned)
    plain = predicted_step_time(planned.plan, planned.table, programs, base)
    assert predicted_step_time(planned.plan, planned.table, programs, _launched(base, 0.5), (0.0, 0.0)) == plain


@pytest.mark.parametrize("schedule,layout", [("1f1b", {}), ("zb-h1", {}), ("zbv", {})])
def test_a_host_slower_than_its_device_sets_the_predicted_step(schedule: str, layout: dict) -> None:
    """Launches three times each program's time: the step is at least the busiest host's launches and posts
    (each transfer posted on both sides; a send after the rank's last compute holds no device back), and posts
    only add time."""
    planned = _planned(schedule, layout)
    programs = [assemble(planned, r) for r in range(2)]
    slow = _launched(_plans_own_times(planned), 3.0)
    launched = [sum(slow.of((i.stage, i.kind, i.accumulated())).launch for i in p.instrs if i.kind in KIND)
                for p in programs]
    bare = predicted_step_time(planned.plan, planned.table, programs, slow)
    assert bare >= max(launched) + planned.plan.allreduce_time
    post = 0.1 * bare
    posted = predicted_step_time(planned.plan, planned.table, programs, slow, (post, post))
    transfers = [sum(len(i.comm) for i in p.instrs if i.kind == "comm") for p in programs]
    assert posted >= max(h + post * (n - 1) for h, n in zip(launched, transfers)) - 1e-12
    assert posted > bare


def test_faster_of_two_measurements_keeps_each_programs_smaller_launch() -> None:
    from engine.execution.profile import faster_of

    a = Profile([ProgramCost(0, "forward", (), 2e-3, None, 1e-3), ProgramCost(1, "forward", (), 2e-3, None)])
    b = Profile([ProgramCost(0, "forward", (), 3e-3, None, 5e-4), ProgramCost(1, "forward", (), 1e-3, None, 7e-4)])
    assert [p.launch for p in faster_of(a, b).programs] == [5e-4, 7e-4]
    assert Profile.from_json(faster_of(a, b).to_json()) == faster_of(a, b)


def test_launches_are_timed_on_cuda_only() -> None:
    from engine.execution.profile import launch_seconds

    assert launch_seconds(lambda: torch.ones(3), torch.device("cpu")) is None


def test_a_program_that_posts_nothing_has_no_post_cost() -> None:
    from engine.execution.post_cost import first_transfers, post_seconds
    from engine.execution.program import Program

    class Bare:
        program = Program(0, ())

    assert post_seconds(Bare()) is None
    planned = _planned("zbv", {})
    got = first_transfers(assemble(planned, 0))
    assert [(c.op, c.what, c.stage, c.peer) for g in got for c in g] == [
        ("send", "act", 0, 1), ("recv", "act", 3, 1), ("send", "grad", 3, 1), ("recv", "grad", 0, 1)]


def test_replayed_graphs_launch_nothing_but_the_host_still_posts() -> None:
    """With CUDA graphs a compute's launch is a replay (microseconds): slow launches are left out, posts are not."""
    planned = _planned("zb-h1", {})
    programs = [assemble(planned, r) for r in range(2)]
    base = _plans_own_times(planned)
    plain = predicted_step_time(planned.plan, planned.table, programs, base)
    slow = _launched(base, 3.0)
    assert predicted_step_time(planned.plan, planned.table, programs, slow, replayed=True) == plain
    assert predicted_step_time(planned.plan, planned.table, programs, slow, (plain, plain), replayed=True) > plain


def test_graphs_that_turned_off_launch_their_programs_again() -> None:
    """A step replays graphs only while they are on: off (a failed capture), or none, its host launches."""
    import types

    fn, params, x, y = _mlp()
    plan = engine.plan(fn, params, x, y, world_size=2, schedule="1f1b", microbatches=4)
    step = build_steps(fn, params, (x, y), plan)[0]
    assert not step.replays_graphs
    for state, replays in (("warm", True), ("capture", True), ("replay", True), ("off", False)):
        step.executor.graphs = types.SimpleNamespace(state=state)
        assert step.replays_graphs is replays


def test_two_measurements_of_the_posts_keep_each_ranks_smaller() -> None:
    from engine.execution.post_cost import faster_posts

    assert faster_posts((2e-4, None, 5e-4), (3e-4, 1e-4, None)) == (2e-4, 1e-4, 5e-4)
    assert faster_posts(None, (1e-4,)) == (1e-4,) and faster_posts((1e-4,), None) == (1e-4,)
    assert faster_posts(None, None) is None
