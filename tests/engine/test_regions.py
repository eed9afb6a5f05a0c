"""Region scales: the calibration times the model's programs span by span, and the planner splits by them."""
from __future__ import annotations

import time
from typing import Any

import attrs
import pytest
import torch

import engine
import ir
from engine.planning.calibration import Calibration, ProgramScale, calibrate_training
from engine.planning.measured import MeasuredScale, Span, combined
from engine.planning.regions import region_cuts, region_scale


def _mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    for w in p["layers"]:
        x = torch.tanh(x @ w)
    return x.sum()


def _model(layers: int = 8, width: int = 64, rows: int = 32) -> tuple[Any, list[torch.Tensor], ir.Graph]:
    torch.manual_seed(0)
    params = {"layers": [torch.randn(width, width) / width ** 0.5 for _ in range(layers)]}
    x = torch.randn(rows, width)
    return params, [*params["layers"], x], ir.trace(_mlp, params, x)


def test_regions_cut_the_forward_time_into_about_equal_spans() -> None:
    assert region_cuts([1.0] * 8, 4) == [2, 4, 6]
    assert region_cuts([4.0, 1, 1, 1, 1], 2) == [1]  # the first equation is half the time
    assert region_cuts([1.0, 1.0, 1.0], 4) == [1, 2]  # fewer equations than regions: one each
    assert region_cuts([0.0, 0.0], 4) == [] and region_cuts([1.0], 4) == []


def test_combined_multiplies_each_equations_ratios_and_keeps_the_later_for_another_graph() -> None:
    regions = MeasuredScale(6, [Span(0, 3, 2.0, 1.0, 1.0), Span(3, 6, 0.5, 1.0, 1.0)])
    stages = MeasuredScale(6, [Span(0, 2, 1.0, 1.5, 1.5), Span(2, 6, 1.0, 2.0, 3.0)])
    both = combined(regions, stages)
    assert both is not None and both.per_eqn(6) == (
        [2.0, 2.0, 2.0, 0.5, 0.5, 0.5], [1.5, 1.5, 2.0, 2.0, 2.0, 2.0], [1.5, 1.5, 3.0, 3.0, 3.0, 3.0])
    assert [(s.start, s.stop) for s in both.spans] == [(0, 2), (2, 3), (3, 6)]
    other = MeasuredScale(7, [Span(0, 7, 3.0, 3.0, 3.0)])
    assert combined(regions, other) is other and combined(None, stages) is stages and combined(regions, None) is regions


def test_a_slow_region_is_measured_slow_relative_to_the_others() -> None:
    """A 'compiler' whose first region's forward sleeps 30 ms a run: that region's F ratio is far above the
    others', its backward is not, and the spans cover the graph."""
    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)  # op times only (no inputs: no program scale, no regions)
    assert cal.regions == {}
    first: dict[str, Any] = {}

    def slow_first(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        fn = ir.compile_graph(graph, acc)
        if acc or first:  # a backward, or a later region's forward
            return fn
        first["graph"] = graph

        def run(*args: Any) -> Any:
            time.sleep(0.03)
            return fn(*args)
        return run

    found, grown = region_scale(g, torch.device("cpu"), cal, inputs, ProgramScale(), compile_program=slow_first)
    assert found is not None and set(cal.times) <= set(grown.times) and found.num_eqns == len(g.eqns)
    assert [s.start for s in found.spans][0] == 0 and found.spans[-1].stop == len(g.eqns)
    assert all(a.stop == b.start for a, b in zip(found.spans, found.spans[1:])) and len(found.spans) == 4
    assert found.spans[0].forward > 20 * max(s.forward for s in found.spans[1:])
    assert found.spans[0].backward_input < 20 * min(s.backward_input for s in found.spans[1:])


def test_calibrate_training_measures_regions_per_compiler_and_saves_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    params, inputs, g = _model(layers=4)
    cal = calibrate_training(g, "cpu", repeats=2, inputs=inputs, compiled={"again": ir.compile_graph})
    assert set(cal.regions) == {"fx", "again"}
    assert all(r.num_eqns == len(g.eqns) and all(s.forward > 0 and s.backward_input > 0 for s in r.spans)
               for r in cal.regions.values())
    cal.save(tmp_path / "cal.json")
    back = Calibration.load(tmp_path / "cal.json")
    assert back == cal
    assert back.for_compiler("again").region == cal.regions["again"] and back.region == cal.regions["fx"]
    assert back.for_compiler("unknown").region == cal.regions["fx"]  # not measured: costed as fx (logged)
    again = calibrate_training(g, "cpu", repeats=2, inputs=inputs, calibration=back, compiled={"again": ir.compile_graph})
    assert again.regions == back.regions  # nothing timed anew: the regions stand


@pytest.mark.parametrize("slow", ["first", "second"])
def test_the_planner_moves_the_cut_off_a_region_measured_slow(slow: str) -> None:
    """The same table with the first (or second) half of the model's equations measured 3 x its ops' sum: the
    two-stage split gives that half fewer equations, and the predicted step grows."""
    params, inputs, g = _model()
    n = len(g.eqns)
    plain = Calibration("cpu", {})
    spans = [Span(0, n // 2, 3.0, 3.0, 3.0), Span(n // 2, n, 1.0, 1.0, 1.0)]
    if slow == "second":
        spans = [Span(0, n // 2, 1.0, 1.0, 1.0), Span(n // 2, n, 3.0, 3.0, 3.0)]
    scaled = attrs.evolve(plain, regions={"fx": MeasuredScale(n, spans)})
    x = inputs[-1]
    even = engine.plan(_mlp, params, x, world_size=2, stages=2, microbatches=2, schedule="1f1b", device="cpu",
                       calibration=plain)
    moved = engine.plan(_mlp, params, x, world_size=2, stages=2, microbatches=2, schedule="1f1b", device="cpu",
                        calibration=scaled)
    assert (moved.cuts[0] < even.cuts[0]) if slow == "first" else (moved.cuts[0] > even.cuts[0])
    assert moved.predicted_step_time > 1.3 * even.predicted_step_time
