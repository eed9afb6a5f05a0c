"""Costing compiled programs: calibration times the model's programs as a compiler makes them, and the
planner costs that compiler's plans with the measured scale."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import engine
import ir
from engine.planning.calibration import Calibration, calibrate_training


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
    which programs it was asked to run."""
    import engine.planning.calibration as calibration

    params = {"layers": [torch.randn(96, 96) for _ in range(3)]}
    x = torch.randn(64, 96)
    g = ir.trace(_mlp, params, x)
    inputs = [*params["layers"], x]
    asked: list = []

    def scripted(ad, graph, device, cal, inputs, *, repeats=5, compile_program=ir.compile_graph):  # noqa: ANN001, ANN202
        asked.append((ad, compile_program))
        return {_twice: 2.0, ir.compile_graph: 1.5}.get(compile_program, 3.0)

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
    (plain, fx), (fused, twice) = asked
    assert fx is ir.compile_graph and twice is _twice
    assert fused.saved_bytes() < plain.saved_bytes()  # compiled programs are timed at the cheap level (gelu redone)
    assert cal.for_compiler("twice").scale == 2.0 and cal.for_compiler("twice").times == cal.times
    assert cal.for_compiler("fx") is cal and cal.for_compiler("inductor") is cal  # not measured: fx's, logged
    assert Calibration.from_json(cal.to_json()) == cal
    assert Calibration.from_json('{"device": "cpu", "times": {}, "scale": 1.5}').compiled == {}  # older tables


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


def test_the_planner_costs_a_compiled_plan_with_its_scale(measured: tuple) -> None:
    g, inputs, cal, _, _ = measured
    params = {"layers": inputs[:3]}
    x = torch.randn(128, 96)
    fx = engine.plan(_mlp, params, x, microbatches=2, device="cpu", calibration=cal)
    twice = engine.plan(_mlp, params, x, microbatches=2, device="cpu", calibration=cal.for_compiler("twice"))
    ratio = cal.compiled["twice"] / cal.scale
    assert twice.predicted_step_time == pytest.approx(ratio * fx.predicted_step_time, rel=0.05)
