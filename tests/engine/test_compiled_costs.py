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
        x = torch.relu(x @ w)
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
    params = {"layers": [torch.randn(96, 96) for _ in range(3)]}
    x = torch.randn(64, 96)
    g = ir.trace(_mlp, params, x)
    inputs = [*params["layers"], x]
    return g, inputs, calibrate_training(g, "cpu", repeats=5, inputs=inputs, compiled={"twice": _twice})


def test_a_compilers_programs_get_their_own_measured_scale(measured: tuple) -> None:
    g, inputs, cal = measured
    assert set(cal.compiled) == {"twice"}
    assert cal.compiled["twice"] == pytest.approx(2 * cal.scale, rel=0.4)  # timing on a shared CPU: loose
    assert cal.for_compiler("twice").scale == cal.compiled["twice"] and cal.for_compiler("twice").times == cal.times
    assert cal.for_compiler("fx") is cal and cal.for_compiler("inductor") is cal  # not measured: fx's, logged
    assert Calibration.from_json(cal.to_json()) == cal
    assert Calibration.from_json('{"device": "cpu", "times": {}, "scale": 1.5}').compiled == {}  # older tables


def test_scales_stand_until_ops_are_timed_again_and_a_new_compiler_is_measured_once(measured: tuple) -> None:
    g, inputs, cal = measured
    assert calibrate_training(g, "cpu", calibration=cal, inputs=inputs, compiled={"twice": _twice}) == cal
    grown = calibrate_training(g, "cpu", calibration=cal, inputs=inputs, compiled={"again": ir.compile_graph})
    assert grown.compiled["twice"] == cal.compiled["twice"] and grown.scale == cal.scale
    assert grown.compiled["again"] == pytest.approx(cal.scale, rel=0.4)


def test_the_planner_costs_a_compiled_plan_with_its_scale(measured: tuple) -> None:
    g, inputs, cal = measured
    params = {"layers": inputs[:3]}
    x = torch.randn(128, 96)
    fx = engine.plan(_mlp, params, x, microbatches=2, device="cpu", calibration=cal)
    twice = engine.plan(_mlp, params, x, microbatches=2, device="cpu", calibration=cal.for_compiler("twice"))
    ratio = cal.compiled["twice"] / cal.scale
    assert twice.predicted_step_time == pytest.approx(ratio * fx.predicted_step_time, rel=0.05)
