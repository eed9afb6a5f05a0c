"""Region scales: the calibration times the model's programs span by span, and the planner splits by them."""
from __future__ import annotations

import gc
import itertools
import time
import weakref
from typing import Any

import attrs
import pytest
import torch

import engine
import ir
from engine.planning.blocks import crossing_bytes, module_cuts
from engine.planning.calibration import Calibration, calibrate_training, signature
from engine.planning.measured import MeasuredScale, Span, batch_key, combined
from engine.planning.regions import _normalised, region_cuts, region_scale, with_regions


def _mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    for w in p["layers"]:
        x = torch.tanh(x @ w)
    return x.sum()


def _model(layers: int = 8, width: int = 64, rows: int = 32) -> tuple[Any, list[torch.Tensor], ir.Graph]:
    torch.manual_seed(0)
    params = {"layers": [torch.randn(width, width) / width ** 0.5 for _ in range(layers)]}
    x = torch.randn(rows, width)
    return params, [*params["layers"], x], ir.trace(_mlp, params, x)


def _slow_first_forward(calls: dict[str, int]) -> Any:
    """A 'compiler' whose first forward program compiled (region 0's) sleeps 30 ms a run; counts compiles."""
    def compile_program(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        fn = ir.compile_graph(graph, acc)
        calls["compiles"] = calls.get("compiles", 0) + 1
        if acc or calls.get("slow"):
            return fn
        calls["slow"] = 1

        def run(*args: Any) -> Any:
            time.sleep(0.03)
            return fn(*args)
        return run
    return compile_program


def test_regions_cut_the_forward_time_into_about_equal_spans() -> None:
    assert region_cuts([1.0] * 8, 4) == [2, 4, 6]
    assert region_cuts([4.0, 1, 1, 1, 1], 2) == [1]  # the first equation is half the time
    assert region_cuts([1.0, 1.0, 1.0], 4) == [1, 2]  # fewer equations than regions: one each
    assert region_cuts([0.0, 0.0], 4) == [] and region_cuts([1.0], 4) == []
    assert region_cuts([1.0] * 8, 4, candidates=[3, 5]) == [3, 5]  # only at module boundaries: the nearest
    assert region_cuts([1.0] * 8, 2, candidates=[]) == []
    assert region_cuts([1.0] * 100, 4, candidates=[1, 99]) == []  # boundaries far from every share: no slivers
    assert region_cuts([1.0] * 100, 4, candidates=[1, 30, 52, 99]) == [30, 52]


def test_the_mlps_regions_fall_between_its_layers() -> None:
    """Module boundaries: a layer's matmul and its tanh stay in one region (a fusing compiler fuses them)."""
    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)
    found, _ = region_scale(g, torch.device("cpu"), cal, inputs)
    assert found is not None
    assert all(g.eqns[s.start].op == "aten.matmul.default" for s in found.spans)  # each span starts at a matmul


def test_combined_multiplies_each_equations_ratios() -> None:
    regions = MeasuredScale(6, [Span(0, 3, 2.0, 1.0, 1.0), Span(3, 6, 0.5, 1.0, 1.0)], "b")
    stages = MeasuredScale(6, [Span(0, 2, 1.0, 1.5, 1.5), Span(2, 6, 1.0, 2.0, 3.0)])
    both = combined(regions, stages)
    assert both is not None and both.per_eqn(6) == (
        [2.0, 2.0, 2.0, 0.5, 0.5, 0.5], [1.5, 1.5, 2.0, 2.0, 2.0, 2.0], [1.5, 1.5, 3.0, 3.0, 3.0, 3.0])
    assert both.fused_per_eqn(6) == [1.5, 1.5, 3.0, 3.0, 3.0, 3.0]  # unmeasured whole backwards: W's
    assert [(s.start, s.stop) for s in both.spans] == [(0, 2), (2, 3), (3, 6)] and both.batch == "b"
    assert combined(None, stages) is stages and combined(regions, None) is regions
    with pytest.raises(ValueError, match="6 and 7 equations"):
        combined(regions, MeasuredScale(7, [Span(0, 7, 3.0, 3.0, 3.0)]))


def test_region_ratios_are_normalised_to_a_weighted_mean_of_one() -> None:
    """Two regions of ops' sums 1 and 3 ms running 2 and 3 ms forward (ratios 2 and 1): their mean weighted by
    the sums is 1.25, so 1.6 and 0.8; the backward likewise on its own sums (ratios 1 and 3, mean 2)."""
    runs = [(0, 4, 1e-3, 2e-3, 2e-3, 2e-3), (4, 9, 3e-3, 2e-3, 3e-3, 6e-3)]
    spans = _normalised(runs)
    assert [(s.start, s.stop) for s in spans] == [(0, 4), (4, 9)]
    assert [s.forward for s in spans] == pytest.approx([1.6, 0.8])
    assert [s.backward_input for s in spans] == pytest.approx([0.5, 1.5])
    assert [s.backward_weight for s in spans] == [s.backward_input for s in spans]


def test_a_regions_b_and_w_take_the_seconds_their_own_programs_ran() -> None:
    """A region whose fused backward ran 2 x its ops' sum (6 ms for 3): B's ops sum 1 ms, W's 2 ms; the split
    programs ran B 1.5 ms and W 5.1 ms (apart they cost 10 % more than fused), so B gets 1.5 x its ops and W
    2.55 x: a schedule that splits them pays the 6.6 ms, one that fuses them the whole backward's 6 ms
    (`Span.backward`). A region without a B (no input grads) or whose split was not measured keeps one ratio."""
    from engine.planning.calibration import ProgramRuns
    from engine.planning.timed import _split_shares

    ran = ProgramRuns(1e-3, 6e-3, [], 1.5e-3, 5.1e-3)
    kb, kw = _split_shares(ran, 3e-3, 1e-3, 2e-3)
    assert (2.0 * kb * 1e-3, 2.0 * kw * 2e-3) == (pytest.approx(1.5e-3), pytest.approx(5.1e-3))
    assert _split_shares(ran, 3e-3, 0.0, 3e-3) is None
    assert _split_shares(ProgramRuns(1e-3, 6e-3, []), 3e-3, 1e-3, 2e-3) is None
    spans = _normalised([(0, 4, 1e-3, 3e-3, 1e-3, 6e-3, kb, kw)])
    assert (spans[0].backward_input, spans[0].backward_weight) == (pytest.approx(0.75), pytest.approx(1.275))
    # beside a region whose backward ran 1 x its 3 ms of ops, undivided: the mean backward ratio, weighted by the
    # fused sums, is 1.5, so the first region's B and W are 2 / 1.5 x its factors and the second's 1 / 1.5
    two = _normalised([(0, 4, 1e-3, 3e-3, 1e-3, 6e-3, kb, kw), (4, 8, 1e-3, 3e-3, 1e-3, 3e-3)])
    assert [(s.backward_input, s.backward_weight) for s in two] == [
        (pytest.approx(2 / 1.5 * 0.75), pytest.approx(2 / 1.5 * 1.275)),
        (pytest.approx(1 / 1.5), pytest.approx(1 / 1.5))]
    assert [s.backward for s in two] == [pytest.approx(2 / 1.5), pytest.approx(1 / 1.5)]  # the whole backward's


def test_a_stage_with_no_b_costs_its_backward_at_the_whole_backwards_ratio() -> None:
    """The first stage's W graph is its whole backward (nothing upstream takes its input grads): under region
    scales whose B runs 0.5 x and W 2 x while the whole backward runs 1 x, the one-stage plan's backward is
    costed at 1 x, and a later stage's B and W at their own ratios."""
    from engine.planning.devices import get_device, get_link
    from engine.planning.op_costs import CostModel
    from engine.planning.stage_costs import exact

    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)
    cpu = get_device("cpu")
    plain = CostModel(cpu, get_link(None, cpu), cal)
    skewed = MeasuredScale(len(g.eqns), [Span(0, len(g.eqns), 1.0, 0.5, 2.0, 1.0)], batch_key(g))
    model = CostModel(cpu, get_link(None, cpu), attrs.evolve(cal, regions={"fx": skewed}))
    (one,), (base,) = exact(g, [], model), exact(g, [], plain)
    assert one.backward_input == base.backward_input == 0.0
    assert one.backward_weight == pytest.approx(base.backward_weight, rel=1e-12)
    cut = len(g.eqns) // 2
    two, bases = exact(g, [cut], model), exact(g, [cut], plain)
    assert two[1].backward_input == pytest.approx(0.5 * bases[1].backward_input, rel=1e-12)
    assert two[1].backward_weight == pytest.approx(2.0 * bases[1].backward_weight, rel=1e-12)
    assert two[0].backward_weight == pytest.approx(bases[0].backward_weight, rel=1e-12)
    fused = exact(g, [cut], attrs.evolve(model, split_backward=False))  # a schedule of one BW program a stage
    assert fused[1].backward_input == pytest.approx(bases[1].backward_input, rel=1e-12)
    assert fused[1].backward_weight == pytest.approx(bases[1].backward_weight, rel=1e-12)
    from engine.planning.blocks import coarsen
    from engine.planning.stage_costs import exact_blocks

    blocks = coarsen(g, model, fine=False, min_blocks=2)  # the splitter's blocks: the first one has no B either
    first = exact(g, [blocks.bounds[1]], model)[0]
    assert exact_blocks(g, blocks, model, split_bw=True).backward_weight[0] == pytest.approx(
        first.backward_weight, rel=1e-12)


def test_a_schedule_is_costed_by_the_backwards_most_of_its_actions_are() -> None:
    import schedules
    from engine.planning.artifacts import build_table
    from engine.planning.stage_costs import mostly_split, splits_bw

    def table(name: str, stages: int, m: int, **opts: Any) -> Any:
        return build_table(schedules.get(name), name, stages, m, opts)

    assert mostly_split(table("zbv", 8, 8)) and mostly_split(table("zb-h1", 2, 4))
    assert not mostly_split(table("1f1b", 2, 4)) and not mostly_split(table("interleaved-1f1b", 4, 4,
                                                                            stages_per_rank=2))
    mixed = table("dualpipev", 8, 16)  # 22 B-W pairs beside 106 fused BW
    assert splits_bw(mixed) and not mostly_split(mixed)


@pytest.mark.parametrize("schedule,split", [("1f1b", False), ("zb-h1", True)])
def test_the_planner_costs_a_backward_as_its_schedule_runs_it(schedule: str, split: bool) -> None:
    """Region scales whose B runs 0.5 x, W 2 x and the whole backward 1.5 x: 1F1B's stages (one BW program
    each) cost their backward at 1.5 x, zb-h1's (B and W apart) at B's and W's own."""
    params, inputs, g = _model()
    x = inputs[-1]
    cal = calibrate_training(g, "cpu", repeats=2)
    skewed = MeasuredScale(len(g.eqns), [Span(0, len(g.eqns), 1.0, 0.5, 2.0, 1.5)])  # any microbatch's graph
    plain = engine.plan(_mlp, params, x, world_size=2, schedule=schedule, microbatches=4, device="cpu",
                        calibration=cal)
    skew = engine.plan(_mlp, params, x, world_size=2, schedule=schedule, microbatches=4, device="cpu",
                       calibration=attrs.evolve(cal, regions={"fx": skewed}), cuts=plain.cuts)
    a, b = plain.stages[1], skew.stages[1]
    if split:
        assert (b.backward_input_time, b.backward_weight_time) == (
            pytest.approx(0.5 * a.backward_input_time), pytest.approx(2.0 * a.backward_weight_time))
    else:
        assert b.backward_input_time + b.backward_weight_time == pytest.approx(
            1.5 * (a.backward_input_time + a.backward_weight_time))


def test_a_region_whose_split_programs_cannot_run_keeps_one_backward_ratio(  # type: ignore[no-untyped-def]
        monkeypatch) -> None:
    """The split B and W hold more beside the fused backward; where they fail (out of memory, scripted here for
    every region's W), the region is timed without them: its scale stands, B and W one ratio."""
    from engine.planning import timed

    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)
    weights: list[ir.Graph] = []
    real = timed.autodiff

    def noting(*args: Any, **kw: Any) -> Any:
        ad = real(*args, **kw)
        weights.append(ad.backward_weight.graph)
        return ad

    def failing_w(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        if any(graph is w for w in weights):
            raise RuntimeError("CUDA out of memory (scripted)")
        return ir.compile_graph(graph, acc)

    monkeypatch.setattr(timed, "autodiff", noting)
    found, _ = region_scale(g, torch.device("cpu"), cal, inputs, compile_program=failing_w)
    assert found is not None and len(found.spans) == 4
    assert all(s.backward_input == s.backward_weight for s in found.spans)


def test_the_mlps_regions_time_b_and_w_apart(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The regions' programs, timed by a 'compiler' whose W programs sleep 20 ms a run: every region after the
    first (the first has no input grads to make) gives W a far larger ratio than B."""
    from engine.planning import timed

    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)
    weights: list[ir.Graph] = []  # held, so no id is reused
    real = timed.autodiff

    def noting(*args: Any, **kw: Any) -> Any:  # the regions' stage autodiff, its W graphs noted
        ad = real(*args, **kw)
        weights.append(ad.backward_weight.graph)
        return ad

    def slow_w(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        fn = ir.compile_graph(graph, acc)
        if not any(graph is w for w in weights):
            return fn

        def run(*args: Any) -> Any:
            time.sleep(0.02)
            return fn(*args)
        return run

    monkeypatch.setattr(timed, "autodiff", noting)
    found, _ = region_scale(g, torch.device("cpu"), cal, inputs, compile_program=slow_w)
    assert found is not None and len(found.spans) == 4 and len(weights) == 4
    assert all(s.backward_weight > 5 * s.backward_input for s in found.spans[1:])


def test_a_slow_region_is_measured_slow_relative_to_the_others() -> None:
    """Region 0's forward sleeps 30 ms a run: its F ratio is far above the others', its backward is not, the
    spans cover the graph, and the scale is recorded for this graph's microbatch."""
    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)  # op times only (no inputs: no program scale)
    found, _ = region_scale(g, torch.device("cpu"), cal, inputs, compile_program=_slow_first_forward({}))
    assert found is not None and found.num_eqns == len(g.eqns) and found.batch == batch_key(g)
    assert found.spans[0].start == 0 and found.spans[-1].stop == len(g.eqns) and len(found.spans) == 4
    assert all(a.stop == b.start for a, b in zip(found.spans, found.spans[1:]))
    assert found.spans[0].forward > 20 * max(s.forward for s in found.spans[1:])
    assert found.spans[0].backward_input < 20 * min(s.backward_input for s in found.spans[1:])


def _slow_while(slow: Any) -> Any:
    """A 'compiler' whose first forward program compiled (region 0's) sleeps 30 ms a run while `slow(run)` (its
    runs counted from 0)."""
    def compile_program(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        fn = ir.compile_graph(graph, acc)
        if acc or compile_program.made:  # type: ignore[attr-defined]
            return fn
        compile_program.made = True  # type: ignore[attr-defined]
        runs = itertools.count()

        def run(*args: Any) -> Any:
            if slow(next(runs)):
                time.sleep(0.03)
            return fn(*args)
        return run
    compile_program.made = False  # type: ignore[attr-defined]
    return compile_program


def test_a_region_slow_only_at_its_first_timing_is_measured_by_its_second() -> None:
    """Each region is timed once right after its compile and again once all are compiled, and keeps each
    program's faster time: region 0's forward, slow through its first timing alone (its first 5 runs: 2 warm
    rounds, 3 timed), is measured about as fast as the others'; slow through both, it stays slow."""
    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)
    dev = torch.device("cpu")
    first, _ = region_scale(g, dev, cal, inputs, compile_program=_slow_while(lambda run: run < 5))
    both, _ = region_scale(g, dev, cal, inputs, compile_program=_slow_while(lambda run: True))
    assert first is not None and both is not None and len(first.spans) == len(both.spans) == 4
    assert both.spans[0].forward > 20 * max(s.forward for s in both.spans[1:])
    assert first.spans[0].forward < 5 * max(s.forward for s in first.spans[1:])


def test_regions_let_go_of_the_ones_before_where_holding_them_runs_out_of_memory(  # type: ignore[no-untyped-def]
        monkeypatch) -> None:
    """The regions are held for their second timing; the third region's timing fails once (out of memory,
    scripted): the ones before are let go, freed before the third is tried again (nothing of them, nor of the
    failed attempt, is alive then), no region is timed a second time, and the scale stands."""
    from engine.planning import timed

    params, inputs, g = _model()
    cal = calibrate_training(g, "cpu", repeats=2)
    made: list[weakref.ref] = []
    alive_at_retry: list[int] = []
    timings: list[int] = []

    class Failing(timed.Programs):  # type: ignore[misc,name-defined]
        def timed(self, repeats: int) -> Any:
            timings.append(len(made))
            if len(made) == 3 and not alive_at_retry:
                alive_at_retry.append(-1)
                raise RuntimeError("CUDA out of memory (scripted)")
            return super().timed(repeats)

    def programs(*args: Any, **kw: Any) -> Any:
        if len(made) == 3 and alive_at_retry == [-1]:  # the third's retry: what is still alive now
            gc.collect()
            alive_at_retry[:] = [i for i, r in enumerate(made) if r() is not None]
        p = Failing(*args, **kw)
        made.append(weakref.ref(p))
        return p

    monkeypatch.setattr(timed, "Programs", programs)
    told: list[str] = []
    monkeypatch.setattr(timed.log, "warning", lambda msg, *a: told.append(msg % a))
    found, _ = region_scale(g, torch.device("cpu"), cal, inputs)
    assert found is not None and len(found.spans) == 4
    assert any("region scales: timed once" in t for t in told) and len(made) == 5  # the third's made twice
    assert alive_at_retry == [], f"still alive when the held regions were let go: {alive_at_retry}"
    assert timings == [1, 2, 3, 4, 5]  # each once (the third's first attempt failed): no second timings


def test_ops_only_a_regions_programs_have_are_timed_and_kept() -> None:
    """A table that lacks the ops of the regions' backward programs (as a cut's input grads are lacking from
    the whole model's table): the regions time them rather than giving up, and the grown table keeps them."""
    params, inputs, g = _model(layers=4)
    cal = calibrate_training(g, "cpu", repeats=2)
    cuts = region_cuts([cal.times.get(signature(e), 0.0) for e in g.eqns], 4, module_cuts(g, crossing_bytes(g)))
    backward_ops = {signature(e) for s in ir.split(g, cuts)
                    for e in ir.stage_autodiff(s.graph, constant=range(len(s.param_ids), len(s.param_ids)
                                                                        + len(s.batch_ids))).backward.graph.eqns}
    lacking = attrs.evolve(cal, times={k: v for k, v in cal.times.items() if k not in backward_ops})
    assert len(lacking.times) < len(cal.times)
    found, grown = region_scale(g, torch.device("cpu"), lacking, inputs)
    assert found is not None and set(cal.times) <= set(grown.times)


def test_with_regions_measures_once_keeps_what_holds_and_measures_again_what_changed(  # type: ignore[no-untyped-def]
        tmp_path) -> None:
    params, inputs, g = _model(layers=4)
    dev = torch.device("cpu")
    calls: dict[str, int] = {}
    table = with_regions(g, dev, calibrate_training(g, "cpu", repeats=2, inputs=inputs), inputs,
                         {"fx": _slow_first_forward(calls)})
    first = calls["compiles"]
    assert set(table.regions) == {"fx"} and table.region == table.regions["fx"] and first > 0
    table.save(tmp_path / "cal.json")
    known = Calibration.load(tmp_path / "cal.json")
    assert known == table  # the regions and their graph's key round-trip
    again = calibrate_training(g, "cpu", repeats=2, inputs=inputs, calibration=known)
    assert with_regions(g, dev, again, inputs, {"fx": _slow_first_forward(calls)}, known) == known
    assert calls["compiles"] == first  # nothing it rests on changed: not measured again
    assert with_regions(g, dev, attrs.evolve(again, scale=again.scale * 2), inputs, {"fx": ir.compile_graph},
                        known).regions == known.regions  # the whole scale does not enter them (normalised)
    retimed = attrs.evolve(again, times={**again.times, "a new op": 1e-3})  # ops timed anew (another model, say)
    redone = with_regions(g, dev, retimed, inputs, {"fx": _slow_first_forward(calls)}, known)
    assert calls["compiles"] > first and redone.regions["fx"].matches(g)  # measured again, not kept


def test_a_table_whose_regions_lack_their_graphs_key_loads_without_them(  # type: ignore[no-untyped-def]
        tmp_path) -> None:
    """Tables of the first version (two fields a region, no graph key) and of the second (B and W one ratio) load,
    their regions to be measured again."""
    import json

    spans = [[0, 5, 1.5, 1.0, 1.0], [5, 10, 0.8, 1.0, 1.0]]
    for regions in ([10, spans], [10, spans, "(4, 8):torch.float32"]):
        path = tmp_path / "old.json"
        path.write_text(json.dumps({"device": "cuda", "times": {"k": 1e-3}, "scale": 1.1, "compiled": {},
                                    "backward_scale": 1.2, "compiled_backward": {}, "regions": {"inductor": regions}}))
        old = Calibration.load(path)
        assert old.regions == {} and old.times == {"k": 1e-3} and old.backward_scale == 1.2


def test_a_region_that_cannot_run_is_recorded_and_not_tried_again() -> None:
    params, inputs, g = _model(layers=4)
    dev = torch.device("cpu")
    tries = {"n": 0}

    def failing(graph: ir.Graph, acc: tuple[int, ...]) -> Any:
        tries["n"] += 1
        raise RuntimeError("CUDA out of memory (scripted)")

    table = calibrate_training(g, "cpu", repeats=2, inputs=inputs)
    out = with_regions(g, dev, table, inputs, {"fx": failing})
    # tried twice: with the split backward, then without it (`timed._held_timed`); then recorded
    assert out.regions["fx"].spans == () and out.regions["fx"].matches(g) and tries["n"] == 2
    assert with_regions(g, dev, out, inputs, {"fx": failing}, out) == out and tries["n"] == 2


@pytest.mark.parametrize("slow", ["first", "second"])
def test_the_planner_moves_the_cut_off_a_region_measured_slow(slow: str) -> None:
    """The same table with the first (or second) half of the model's equations measured 3 x its ops' sum: the
    two-stage split gives that half fewer equations, and the predicted step grows."""
    params, inputs, g = _model()
    n, x = len(g.eqns), inputs[-1]
    spans = [Span(0, n // 2, 3.0, 3.0, 3.0), Span(n // 2, n, 1.0, 1.0, 1.0)]
    if slow == "second":
        spans = [Span(0, n // 2, 1.0, 1.0, 1.0), Span(n // 2, n, 3.0, 3.0, 3.0)]
    plain = Calibration("cpu", {})
    micro = ir.trace(_mlp, params, x[: x.shape[0] // 2])  # the planner's microbatch graph (2 microbatches)
    scaled = attrs.evolve(plain, regions={"fx": MeasuredScale(n, spans, batch_key(micro))})
    kw = dict(world_size=2, stages=2, microbatches=2, schedule="1f1b", device="cpu")
    even = engine.plan(_mlp, params, x, calibration=plain, **kw)
    moved = engine.plan(_mlp, params, x, calibration=scaled, **kw)
    assert (moved.cuts[0] < even.cuts[0]) if slow == "first" else (moved.cuts[0] > even.cuts[0])
    assert moved.predicted_step_time > 1.3 * even.predicted_step_time
    other = engine.plan(_mlp, params, x, calibration=scaled, **dict(kw, microbatches=4))  # another graph
    assert other == engine.plan(_mlp, params, x, calibration=plain, **dict(kw, microbatches=4))


def test_a_hugging_face_llama_gets_region_scales_through_parallelize(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A model we did not write (transformers' Llama, tiny config, float64): `parallelize(calibrate=path)` measures
    fx's region scales on its microbatch graph, normalised, and a second launch on the saved table keeps them."""
    from tests.models import zoo

    c = zoo.causal_lm("llama")
    path = tmp_path / "cal.json"
    step = engine.parallelize(c.fn, c.params, *c.batch, microbatches=2, schedule="1f1b", calibrate=path)
    loss, _ = step(step.shard(c.params), *c.batch)
    step.close()
    table = Calibration.load(path)
    region = table.regions["fx"]
    assert torch.isfinite(loss) and len(region.spans) >= 2 and region.num_eqns == len(step.graph.eqns)
    assert region.matches(step.graph) and all(0.2 < s.forward < 5 and 0.2 < s.backward_input < 5 for s in region.spans)
    again = engine.parallelize(c.fn, c.params, *c.batch, microbatches=2, schedule="1f1b", calibrate=path)
    again.close()
    assert Calibration.load(path).regions == table.regions
