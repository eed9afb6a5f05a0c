"""Costing compiled programs: calibration times the model's programs as a compiler makes them, and the
planner costs that compiler's plans with the measured scale."""
from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import engine
import ir
from engine.planning.calibration import Calibration, ProgramScale, calibrate_training


def _mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    for w in p["layers"]:
        x = torch.nn.functional.gelu(x @ w)
    return x.sum()


def _twice(graph: ir.Graph, accumulate: tuple[int, ...]) -> Any:
    """A 'compiler' whose programs take twice fx's time (each runs its fx program twice; accumulated
    outputs are added once, from the second run, so the numbers stay right)."""
    plain, acc = ir.compile_graph(graph), ir.compile_graph(graph, accumulate)

    def run(*args: Any) -> Any:
        plain(*args[: len(graph.inputs)])
        return acc(*args)

    return run


@pytest.fixture(scope="module")
def measured() -> tuple:
    """A calibration whose program runs are scripted (CPU timings on a shared machine are too noisy to
    assert ratios of): `program_scale` answers 2.0 for the "twice" compiler and 1.5 for fx, and records
    which programs it was asked to run; each compiler's backward programs scale twice its forwards'.""" 
    import engine.planning.calibration as calibration

    params = {"layers": [torch.randn(96, 96) for _ in range(3)]}
    x = torch.randn(64, 96)
    g = ir.trace(_mlp, params, x)
    inputs = [*params["layers"], x]
    asked: list = []

    def scripted(ad, graph, device, cal, inputs, *, repeats=5, compile_program=ir.compile_graph):  # noqa: ANN001, ANN202
        asked.append((ad, compile_program))
        factor = {_twice: 2.0, ir.compile_graph: 1.5}.get(compile_program, 3.0)
        return ProgramScale(factor, 2 * factor)  # backwards: twice the forwards' scale

    real = calibration.program_scale
    calibration.program_scale = scripted
    try:
        cal = calibrate_training(g, "cpu", repeats=2, inputs=inputs, compiled={"twice": _twice})
    finally:
        calibration.program_scale = real
    return g, inputs, cal, asked, scripted


def test_a_compilers_programs_get_their_own_measured_scale(measured: tuple) -> None:
    g, inputs, cal, asked, _ = measured
    assert cal.scale == 1.5 and cal.compiled == {"twice": 2.0}
    assert cal.backward_scale == 3.0 and cal.compiled_backward == {"twice": 4.0} and cal.backward_ratio == 2.0
    (plain, fx), (fused, twice) = asked
    assert fx is ir.compile_graph and twice is _twice
    assert fused.saved_bytes() < plain.saved_bytes()  # compiled programs are timed at the cheap level (gelu redone)
    assert cal.for_compiler("twice").scale == 2.0 and cal.for_compiler("twice").times == cal.times
    assert cal.for_compiler("twice").backward_scale == 4.0
    assert cal.for_compiler("fx") is cal and cal.for_compiler("inductor") is cal  # not measured: fx's, logged
    assert Calibration.from_json(cal.to_json()) == cal
    older = Calibration.from_json('{"device": "cpu", "times": {}, "scale": 1.5}')  # tables from before the split
    assert older.compiled == {} and older.backward_scale is None and older.backward_ratio == 1.0


def test_scales_stand_until_ops_are_timed_again_and_a_new_compiler_is_measured_once(measured: tuple) -> None:
    import engine.planning.calibration as calibration

    g, inputs, cal, asked, scripted = measured
    real, calibration.program_scale = calibration.program_scale, scripted
    try:
        assert calibrate_training(g, "cpu", calibration=cal, inputs=inputs, compiled={"twice": _twice}) == cal
        n = len(asked)
        grown = calibrate_training(g, "cpu", calibration=cal, inputs=inputs, compiled={"other": lambda *a: None})
    finally:
        calibration.program_scale = real
    assert len(asked) == n + 1  # only the new compiler's programs ran
    assert grown.compiled == {"twice": 2.0, "other": 3.0} and grown.scale == cal.scale
    assert grown.compiled_backward == {"twice": 4.0, "other": 6.0} and grown.backward_scale == cal.backward_scale


def test_the_planner_costs_a_compiled_plan_with_its_scale(measured: tuple) -> None:
    g, inputs, cal, _, _ = measured
    params = {"layers": inputs[:3]}
    x = torch.randn(128, 96)
    fx = engine.plan(_mlp, params, x, microbatches=2, device="cpu", calibration=cal)
    twice = engine.plan(_mlp, params, x, microbatches=2, device="cpu", calibration=cal.for_compiler("twice"))
    ratio = cal.compiled["twice"] / cal.scale  # forwards and backwards alike: 2 / 1.5 (4 / 3)
    assert twice.predicted_step_time == pytest.approx(ratio * fx.predicted_step_time, rel=0.05)


def _models(cal: Calibration, ratio: float):  # type: ignore[no-untyped-def]
    """Cost models with the table's scale for forwards and `ratio` x it for backwards, and with 1 x."""
    import attrs

    from engine.planning.devices import LINKS, get_device
    from engine.planning.op_costs import CostModel

    same = attrs.evolve(cal, backward_scale=cal.scale)
    scaled = attrs.evolve(same, backward_scale=ratio * cal.scale)
    return (CostModel(get_device("cpu"), LINKS["loopback"], same),
            CostModel(get_device("cpu"), LINKS["loopback"], scaled))


def test_the_backward_scale_multiplies_b_and_w_and_not_f(measured: tuple) -> None:
    """The planner's exact stage costs, two stages: with the backward programs' scale doubled, B and W cost
    twice as much and F the same; a stage that redoes its forward in B (recompute) pays that forward at the
    forward's scale: B = 2 x B - F."""
    from engine.planning.stage_costs import exact

    g, _, cal, _, _ = measured
    one, two = _models(cal, 2.0)
    cut = [len(g.eqns) // 2]
    for a, b in zip(exact(g, cut, one), exact(g, cut, two)):
        assert a.backward_input + a.backward_weight > 0
        assert b.forward == pytest.approx(a.forward, rel=1e-12)
        assert b.backward_input == pytest.approx(2 * a.backward_input, rel=1e-12)
        assert b.backward_weight == pytest.approx(2 * a.backward_weight, rel=1e-12)
    a, b = exact(g, cut, one, recompute=[True, True])[1], exact(g, cut, two, recompute=[True, True])[1]
    assert a.backward_input > a.forward > 0
    assert b.backward_input == pytest.approx(2 * a.backward_input - a.forward, rel=1e-12)


def test_the_block_estimates_take_the_backward_scale_too(measured: tuple) -> None:
    from engine.planning.blocks import coarsen

    g, _, cal, _, _ = measured
    one, two = _models(cal, 2.0)
    a, b = coarsen(g, one, min_blocks=3), coarsen(g, two, min_blocks=3)
    assert a.bounds == b.bounds and sum(a.backward_weight) > 0
    assert b.forward == pytest.approx(a.forward, rel=1e-12)
    assert b.backward_input == pytest.approx([2 * t for t in a.backward_input], rel=1e-12)
    assert b.backward_weight == pytest.approx([2 * t for t in a.backward_weight], rel=1e-12)


def test_a_table_from_before_the_backward_scale_gets_it_measured(measured: tuple) -> None:
    """A table saved with one scale (no backward_scale) is measured again when real inputs come."""
    import attrs

    g, inputs, cal, _, _ = measured
    older = attrs.evolve(cal, backward_scale=None, compiled={}, compiled_backward={})
    again = calibrate_training(g, "cpu", calibration=older, inputs=inputs, repeats=2)
    assert again.backward_scale is not None and 0.01 < again.backward_scale < 100


def test_forward_and_backward_programs_are_timed_apart() -> None:
    """`program_seconds` with a 'compiler' whose forward sleeps 10 ms and backward 30 ms a run; with `split`,
    B's program 5 ms and W's 20 ms as well, each timed on its own."""
    import time

    from engine.planning import calibration as C

    params = {"layers": [torch.randn(32, 32) for _ in range(2)]}
    x = torch.randn(8, 32)
    g = ir.trace(_mlp, params, x)
    ad = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs)))

    def slow(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        waits = {id(ad.forward.graph): 0.01, id(ad.backward.graph): 0.03, id(ad.backward_input.graph): 0.005,
                 id(ad.backward_weight.graph): 0.02}
        fn, wait = ir.compile_graph(graph, acc), waits[id(graph)]

        def run(*args: Any) -> Any:
            time.sleep(wait)
            return fn(*args)
        return run

    grads = {s: i for i, s in enumerate(ad.grad_slots[: g.num_params]) if s is not None}
    acc = tuple(k for k, slot in enumerate(ad.backward.out_slots) if slot in grads)
    runs = C.program_seconds(ad, torch.device("cpu"), [*params["layers"], x], acc, grads, 3, slow)
    assert 0.0095 < runs.forward < 0.025 and 0.0295 < runs.backward < 0.05
    assert runs.backward_input is None and runs.backward_weight is None
    split = C.program_seconds(ad, torch.device("cpu"), [*params["layers"], x], acc, grads, 3, slow, split=True)
    assert 0.0095 < split.forward < 0.025 and 0.0295 < split.backward < 0.05
    assert split.backward_input is not None and split.backward_weight is not None
    assert 0.0045 < split.backward_input < 0.015 and 0.0195 < split.backward_weight < 0.04


def test_a_slow_first_round_does_not_set_the_program_time() -> None:
    """The first timed round starts from an idle device (the clock syncs first): a launch-bound forward ran
    there 1.6 x its other rounds (ResNet-101x4 fx on an H100, 41.8 against 26.4-27.7 ms), and the mean of five
    rounds planned every forward 1.5 x slow. Here the forward sleeps 60 ms in its first timed run and 10 ms
    after, so the mean would be 20 ms; the median round is 10."""
    import time

    from engine.planning import calibration as C

    params = {"layers": [torch.randn(32, 32) for _ in range(2)]}
    x = torch.randn(8, 32)
    g = ir.trace(_mlp, params, x)
    ad = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs)))
    runs = {"forward": 0}

    def first_slow(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        fn = ir.compile_graph(graph, acc)
        if graph is not ad.forward.graph:
            return fn

        def run(*args: Any) -> Any:
            runs["forward"] += 1
            time.sleep(0.06 if runs["forward"] == C.WARM_ROUNDS + 1 else 0.01)
            return fn(*args)
        return run

    grads = {s: i for i, s in enumerate(ad.grad_slots[: g.num_params]) if s is not None}
    acc = tuple(k for k, slot in enumerate(ad.backward.out_slots) if slot in grads)
    f = C.program_seconds(ad, torch.device("cpu"), [*params["layers"], x], acc, grads, 5, first_slow).forward
    assert runs["forward"] == C.WARM_ROUNDS + 5
    assert 0.0095 < f < 0.016


def _paced_programs(monkeypatch, sleep: Any,  # type: ignore[no-untyped-def]
                    queued: bool = False) -> tuple[Any, list[float]]:
    """Programs of a two-layer MLP built on the CPU and then taken for CUDA's (syncs a no-op, no settling, the
    device's spins recorded), their forward sleeping `sleep(spun)` seconds a run, `spun` whether a spin came."""
    import time
    from types import SimpleNamespace

    from engine.planning import calibration as C

    spins: list[float] = []
    monkeypatch.setattr(C, "_sync", lambda device: None)
    monkeypatch.setattr(C, "spin_device", lambda device, seconds: spins.append(seconds) if seconds > 0 else None)
    monkeypatch.setenv(C.SETTLE, "0")
    params = {"layers": [torch.randn(32, 32) for _ in range(2)]}
    x = torch.randn(8, 32)
    g = ir.trace(_mlp, params, x)
    ad = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs)))
    runs = itertools.count()

    def paced(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        fn = ir.compile_graph(graph, acc)
        if graph is not ad.forward.graph:
            return fn

        def run(*args: Any) -> Any:
            time.sleep(sleep(next(runs), bool(spins)))
            return fn(*args)
        return run

    grads = {s: i for i, s in enumerate(ad.grad_slots[: g.num_params]) if s is not None}
    acc = tuple(k for k, slot in enumerate(ad.backward.out_slots) if slot in grads)
    programs = C.Programs(ad, torch.device("cpu"), [*params["layers"], x], acc, grads, paced, queued=queued)
    programs.device = SimpleNamespace(type="cuda")  # type: ignore[assignment]
    return programs, spins


def test_rounds_their_launches_pace_are_timed_again_behind_a_spin_of_the_device(  # type: ignore[no-untyped-def]
        monkeypatch) -> None:
    """A warm round issued to an idle device takes as long as a timed round (the launches pace the rounds: on a
    real device they are timed at the host's pace), so the rounds are timed again after the device is made to
    spin about as long as their launches take; the second timing stands (here 10 ms a forward, after 30)."""
    programs, spins = _paced_programs(monkeypatch, lambda run, spun: 0.01 if spun else 0.03)
    f = programs.timed(3).forward
    assert len(spins) == 1 and spins[0] >= 1.25 * 3 * 0.03
    assert 0.0095 < f < 0.02


def test_rounds_the_device_paces_are_timed_once(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Warm rounds issued in 1 ms, timed rounds of 30 ms: the device paced them; no spin, no second timing."""
    from engine.planning import calibration as C

    programs, spins = _paced_programs(monkeypatch, lambda run, spun: 0.001 if run < C.WARM_ROUNDS else 0.03)
    f = programs.timed(3).forward
    assert spins == [] and 0.0295 < f < 0.045


def test_queued_programs_are_timed_behind_a_spin_from_the_first(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A block's piece (`queued`): timed once, behind a spin 1.25 x as long as its rounds' launches."""
    programs, spins = _paced_programs(monkeypatch, lambda run, spun: 0.01, queued=True)
    f = programs.timed(3).forward
    assert len(spins) == 1 and spins[0] >= 1.25 * 3 * 0.01 and 0.0095 < f < 0.02


def test_rounds_issued_slower_than_their_spin_are_timed_again_behind_a_longer_one(  # type: ignore[no-untyped-def]
        monkeypatch) -> None:
    """The host slows down after the warm rounds (other processes' compiles): the timed rounds take longer to
    issue than the spin ahead of them lasts, so the device waited on them; they are timed again behind a spin
    1.5 x their issue time."""
    from engine.planning import calibration as C

    programs, spins = _paced_programs(monkeypatch, lambda run, spun: 0.001 if run < C.WARM_ROUNDS else 0.02,
                                      queued=True)
    programs.timed(3)
    assert len(spins) == 2 and spins[1] >= 1.5 * 3 * 0.02 > spins[0]


def test_a_spin_is_nothing_off_cuda() -> None:
    from engine.planning.calibration import spin_device

    spin_device(torch.device("cpu"), 1.0)  # returns at once: no CUDA call


def test_a_stage_whose_b_makes_a_norms_weight_grad_times_b_and_w_apart() -> None:
    """GPT's LayerNorm: B makes the norm's weight grad and hands it to W, which adds it up (the runtime adds
    nothing in B). The split programs run as the runtime runs them: every stage of a GPT cut anywhere times its
    B and W apart (it failed on W's None input when B added that grad itself, and each region then fell back to
    one ratio for B and W)."""
    from torch.utils import _pytree as pytree

    from engine.planning import calibration as C
    from engine.planning.artifacts import autodiff
    from examples import gpt_model

    cfg = gpt_model.GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=4, head_dim=16, tied=False)
    params = gpt_model.init_params(cfg)
    tokens, targets = gpt_model.example_batch(cfg, 4)
    g = ir.trace(gpt_model.make_loss_fn(cfg), params, tokens, targets)
    inputs = pytree.tree_leaves((params, tokens, targets))
    cal = C.calibrate_training(g, "cpu", repeats=1, inputs=inputs)
    for cut in (18, 33, 48):
        for stage in ir.split(g, [cut]):
            ad = autodiff(stage, False, device="cpu")
            sums = C.ops_sums(ad, stage.graph, cal)
            ins = [inputs[i] for i in (*stage.param_ids, *stage.batch_ids)]
            runs = C.Programs(ad, torch.device("cpu"), ins, sums.accumulate, sums.param_grads, ir.compile_graph,
                              split=True).timed(1)
            assert runs.backward_weight is not None and runs.backward_weight > 0, (cut, stage.start)
