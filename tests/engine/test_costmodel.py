"""Cost model (roofline, links, calibration, backward estimates), memory model, and block coarsening."""
from __future__ import annotations

import attrs
import pytest
import torch

import ir
import schedules
from engine.planning.blocks import coarsen, crossing_bytes, module_cuts
from engine.planning.calibration import Calibration, calibrate, signature
from engine.planning.op_costs import CostModel, backward_estimates
from engine.planning.devices import H100, H200, LINKS, get_device, get_link
from engine.errors import PlanError
from engine.planning.memory import MemoryModel, StageMemory, peak_live, rank_peaks, rank_static, stage_peaks
from engine.planning.stage_costs import transient_bytes
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

H100_MODEL = CostModel(H100, LINKS["nvlink"])


def _graph(fn, *args) -> ir.Graph:  # type: ignore[no-untyped-def]
    return ir.trace(fn, *args)


def _mm(p: dict, x: torch.Tensor) -> torch.Tensor:
    return (x @ p["w"]).sum()


def test_matmul_is_compute_bound_at_70_percent_of_the_datasheet() -> None:
    w, x = ir.TensorSpec((8192, 8192), torch.bfloat16), ir.TensorSpec((8192, 8192), torch.bfloat16)
    e = _graph(_mm, {"w": w}, x).eqns[0]
    flops = 2 * 8192**3
    assert H100_MODEL.eqn_time(e) == pytest.approx(5e-6 + flops / (989e12 * 0.7))
    assert CostModel(H200, LINKS["nvlink"]).eqn_time(e) == pytest.approx(H100_MODEL.eqn_time(e))
    fp32 = _graph(_mm, {"w": ir.TensorSpec((8192, 8192))}, ir.TensorSpec((8192, 8192))).eqns[0]
    assert H100_MODEL.eqn_time(fp32) == pytest.approx(5e-6 + flops / (67e12 * 0.7))


def test_elementwise_is_bandwidth_bound_and_views_are_free() -> None:
    def fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x.view(-1) * p["s"])).sum()

    g = _graph(fn, {"s": ir.TensorSpec(())}, ir.TensorSpec((1 << 24,)))
    view, mul = g.eqns[0], g.eqns[1]
    assert H100_MODEL.eqn_time(view) == 0.0
    nbytes = ir.eqn_cost(mul).bytes
    assert nbytes == 2 * 4 * (1 << 24) + 4
    assert H100_MODEL.eqn_time(mul) == pytest.approx(5e-6 + nbytes / (3.35e12 * 0.8))
    h200 = CostModel(H200, LINKS["nvlink"]).eqn_time(mul)
    assert h200 == pytest.approx(5e-6 + nbytes / (4.8e12 * 0.8))


def test_links_and_all_reduce() -> None:
    nv = get_link("nvlink", H100)
    assert nv.time(450e9) == pytest.approx(1.0 + 5e-6) and nv.time(0) == 0.0
    assert get_link(None, H100).name == "nvlink" and get_link(None, get_device("cpu")).name == "loopback"
    assert get_link("network", H100).bandwidth == 12.5e9 and get_link("pcie", H100).bandwidth == 25e9
    assert H100_MODEL.allreduce_time(8e9, 8) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 8e9 / 450e9)
    assert H100_MODEL.allreduce_time(8e9, 1) == 0.0


def test_unknown_device_and_link_name_the_choices() -> None:
    with pytest.raises(PlanError, match=r"unknown device 'tpu'; use one of \['cpu', 'h100', 'h200'\]"):
        get_device("tpu")
    with pytest.raises(PlanError, match="unknown link 'carrier-pigeon'"):
        get_link("carrier-pigeon", H100)
    assert get_device("H200").memory_bytes == 141 * 10**9


def _mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    for w in p["layers"]:
        x = torch.relu(x @ w)
    return x.sum()


def test_backward_estimate_is_two_forwards_of_matmuls() -> None:
    params = {"layers": [ir.TensorSpec((4096, 4096), torch.bfloat16)] * 3}
    g = _graph(_mlp, params, ir.TensorSpec((4096, 4096), torch.bfloat16))
    times = H100_MODEL.eqn_times(g)
    b, w = backward_estimates(g, times)
    mms = [i for i, e in enumerate(g.eqns) if e.op in ("aten.mm.default", "aten.matmul.default")]
    assert len(mms) == 3
    assert w[mms[0]] == times[mms[0]] and b[mms[0]] == 0.0  # the first input is data: no input grad
    assert all(b[i] == w[i] == times[i] for i in mms[1:])


def test_calibration_times_each_signature_once_and_overrides_the_roofline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    params = {"layers": [torch.randn(64, 64) for _ in range(4)]}
    g = _graph(_mlp, params, torch.randn(32, 64))
    cal = calibrate(g, "cpu", repeats=3)
    assert len(cal.times) == 3  # mm, relu, sum: four layers share two signatures
    assert all(t > 0 for t in cal.times.values())
    model = CostModel(get_device("cpu"), LINKS["loopback"], cal)
    assert model.eqn_time(g.eqns[0]) == cal.times[signature(g.eqns[0])]
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    assert calibrate(g, "cpu", calibration=cal) == cal  # nothing new to time


def test_a_saved_calibration_is_completed_for_new_microbatch_shapes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A table saved for one microbatch size lacks the shapes of another: they are timed, not guessed."""
    from engine.execution.launch import World
    from engine.execution.step import microbatch_example
    from engine.parallelize import calibration
    from engine.planning.artifacts import Workshop

    params = {"layers": [torch.randn(64, 64) for _ in range(2)]}
    x = torch.randn(32, 64)
    world, path = World(0, 1, 0, torch.device("cpu"), False), tmp_path / "cal.json"
    first = calibration(world, Workshop(_mlp, params, (x,)), path, microbatches=2, dp=1)
    grown = calibration(world, Workshop(_mlp, params, (x,)), path, microbatches=4, dp=1)
    assert set(first.times) < set(grown.times) and Calibration.load(path) == grown
    g4 = ir.trace(_mlp, params, *microbatch_example((x,), 4))
    costly = [e for e in g4.eqns if ir.eqn_cost(e).flops or ir.eqn_cost(e).bytes]
    assert costly and all(signature(e) in grown.times for e in costly)
    assert calibration(world, Workshop(_mlp, params, (x,)), path, microbatches=4, dp=1) == grown  # nothing new: the file is reused


def _one_f_one_b(p: int, m: int) -> schedules.Table:
    return schedules.get("1f1b")(p, m)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (3, 5)])
def test_peak_live_matches_the_analytic_limits(p: int, m: int) -> None:
    assert peak_live(_one_f_one_b(p, m)) == tuple(min(m, p - r) for r in range(p))
    assert peak_live(schedules.get("gpipe")(p, m)) == (m,) * p


@pytest.mark.parametrize(("name", "live"), [("gpipe", lambda p, m, s: m), ("1f1b", lambda p, m, s: min(m, p - s))])
def test_stage_and_rank_peaks_are_the_analytic_ones(name: str, live) -> None:  # type: ignore[no-untyped-def]
    """One stage a rank, B and W fused: a stage holds `live` microbatches of its activations at its peak."""
    p, m = 4, 8
    table = schedules.get(name)(p, m)
    mems = [StageMemory(100.0 * s + 10, 7.0 + s, 0.0, None, 5.0 * s) for s in range(p)]
    model = MemoryModel(margin=0.1)
    want = [(mems[s].static + mems[s].workspace + live(p, m, s) * mems[s].per_microbatch) * 1.1 for s in range(p)]
    assert stage_peaks(table, mems, model) == pytest.approx(want)
    assert rank_peaks(table, mems, model) == pytest.approx(want)  # a rank holds one stage


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "interleaved-1f1b"])
@pytest.mark.parametrize("after_b", [None, 2.0, 30.0])  # less than F's saved bytes, or more (cotangents W reads)
def test_a_stage_alone_never_peaks_above_its_rank(name: str, after_b: float | None) -> None:
    stages = 8 if name in ("zbv", "interleaved-1f1b") else 4
    table = schedules.get(name)(stages, 8)
    mems = [StageMemory(100.0 * s + 10, 7.0 + s, 3.0 * (s % 2), None if after_b is None else after_b + s % 3,
                        5.0 * s) for s in range(stages)]
    model = MemoryModel(margin=0.1)
    alone, ranks = stage_peaks(table, mems, model), rank_peaks(table, mems, model)
    assert all(alone[s] <= ranks[table.rank_of(s)] + 1e-9 for s in range(stages))
    statics = [rank_static(table, mems, r) * 1.1 for r in range(table.num_ranks)]
    assert all(r > st for r, st in zip(ranks, statics))  # every rank holds some microbatch at its peak


def test_stage_memory_counts_weights_grads_adam_and_buffers() -> None:
    m = MemoryModel().stage(param_bytes=100, saved_bytes=30, recv_bytes=5, send_bytes=7)
    assert m == StageMemory(static=100 * 4 + 2 * 12, per_microbatch=35)
    assert MemoryModel().peak(m, 3) == pytest.approx((424 + 3 * 35) * 1.1)


def test_gpt_blocks_cut_where_one_residual_crosses() -> None:
    cfg = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=3, head_dim=16)
    params = init_params(cfg, torch.float32, "meta")
    g = ir.trace(make_loss_fn(cfg), params, *example_batch(cfg, 2, "meta"))
    cross = crossing_bytes(g)
    residual = 2 * 32 * 64 * 4
    cuts = module_cuts(g, cross)
    names = dict(zip(g.inputs, g.input_names))
    ln1 = [i for i, e in enumerate(g.eqns) if e.op == "aten.layer_norm.default"
           and names.get(e.inputs[1], "").endswith("ln1.weight")]
    assert len(ln1) == cfg.n_layers
    assert set(ln1) <= set(cuts) and all(cross[c] == residual for c in ln1)
    coarse, fine = coarsen(g, H100_MODEL), coarsen(g, H100_MODEL, fine=True)
    assert fine.num_blocks == coarse.num_blocks + cfg.n_layers  # one more cut per block: after attention
    assert set(coarse.bounds) < set(fine.bounds)
    assert sum(coarse.forward) == pytest.approx(H100_MODEL.graph_time(g))
    assert sum(sum(coarse.param_bytes[p] for p in ps) for ps in coarse.params) >= sum(v.aval.nbytes for v in g.params)


def test_transient_bytes_frees_values_at_last_use() -> None:
    def fn(p: dict, x: torch.Tensor) -> torch.Tensor:
        return (torch.relu(x @ p["w"]) * 2).sum()

    g = _graph(fn, {"w": ir.TensorSpec((64, 256))}, ir.TensorSpec((128, 64)))
    # x@w, then relu while x@w is live, then *2 while relu is live: two [128, 256] f32 at once, never three
    assert transient_bytes(g) == 2 * 128 * 256 * 4


def test_calibration_signature_ignores_the_device_index():
    """Ranks trace on cuda:0, cuda:1, ...; a factory op's device argument must not split their tables
    (different tables would give ranks different plans)."""
    import ir as _ir
    from engine.planning.calibration import signature

    out = _ir.Var(_ir.AbstractValue((4,), torch.float32, "cuda:0"))
    make = lambda index: _ir.Eqn("aten.zeros.default", ([4],), (("device", torch.device("cuda", index)),), (out,))  # noqa: E731
    assert signature(make(0)) == signature(make(1))


def test_between_b_and_w_a_microbatch_holds_only_what_w_reads() -> None:
    """ZB-H1 runs B and W apart: once B is done, a microbatch keeps what W reads (`after_b`), not all of
    F's saved values. Rank 1 of p=2, m=4 runs 1F0 1B0 1F1 1B1 1W0: while 1B1 makes its hand-over to W,
    it holds microbatch 1 (10 + 5) and microbatch 0 after its B, 2.5 instead of 10 + 5: 117.5 bytes, not
    130. Rank 0 peaks inside 0B0 with two microbatches in flight (0W0 follows at once), 125 either way."""
    table = schedules.get("zb-h1")(2, 4)
    model = MemoryModel(optimizer_factor=0.0, margin=0.0)
    plain = StageMemory(100.0, 10.0, 5.0)
    lean = StageMemory(100.0, 10.0, 5.0, after_b=2.5)
    assert plain.between_b_and_w == 15.0 and lean.between_b_and_w == 2.5
    assert rank_peaks(table, [plain, plain], model) == (125.0, 130.0)
    assert rank_peaks(table, [lean, lean], model) == (125.0, 117.5)
    assert peak_live(table) == (2, 2)


def test_a_table_that_covers_the_graph_is_kept_without_differentiating_it(monkeypatch) -> None:
    """calibrate_training on a table whose `covered` holds the graph's digest, with every scale asked for, returns
    it as it is and never differentiates the model; another graph, or a compiler not measured yet, does the work."""
    from engine.planning import calibration as calmod

    params = {"layers": [torch.randn(16, 16) for _ in range(2)]}
    x = torch.randn(8, 16)
    g, other = _graph(_mlp, params, x), _graph(_mlp, params, x[:4])
    inputs = [*params["layers"], x]
    cal = calmod.calibrate_training(g, "cpu", repeats=2, inputs=inputs)
    made = []
    real = ir.stage_autodiff
    monkeypatch.setattr(ir, "stage_autodiff", lambda *a, **k: made.append(1) or real(*a, **k))
    assert calmod.calibrate_training(g, "cpu", calibration=cal, inputs=inputs) is cal and not made
    assert calmod.calibrate_training(g, "cpu", calibration=cal) is cal and not made  # no inputs: no scale asked
    grown = calmod.calibrate_training(other, "cpu", repeats=2, calibration=cal)
    assert made and set(grown.covered) == {ir.program_digest(g), ir.program_digest(other)}
    made.clear()
    calmod.calibrate_training(g, "cpu", repeats=2, calibration=cal, inputs=inputs,
                              compiled={"fx2": ir.compile_graph})  # a compiler whose scale is not in the table
    assert made


def test_the_program_scale_is_measured_saved_and_multiplies_every_calibrated_time(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """calibrate_training times each op and each weight grad's accumulation, then runs the whole forward
    and backward on the real inputs and keeps measured / summed times; the cost model scales calibrated
    times by it, the forward's or in a backward program the backward's (roofline ones stay as they are)."""
    from engine.planning.calibration import accumulate_signature, calibrate_training

    params = {"layers": [torch.randn(64, 64) for _ in range(3)]}
    x = torch.randn(32, 64)
    g = _graph(_mlp, params, x)
    assert calibrate_training(g, "cpu", repeats=3).scale == 1.0  # no real inputs: not measured
    cal = calibrate_training(g, "cpu", repeats=3, inputs=[*params["layers"], x])
    assert accumulate_signature(g.inputs[0].aval) in cal.times
    assert 0.05 < cal.scale < 50 and cal.scale != 1.0  # measured: some finite ratio, not the default
    assert 0.05 < cal.backward_scale < 50 and cal.backward_scale != cal.scale  # the backward's, measured apart
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    assert calibrate_training(g, "cpu", calibration=cal, inputs=[*params["layers"], x]) == cal  # nothing new
    assert cal.covered == (ir.program_digest(g),)  # every op of g's step timed: a warm start skips the autodiff
    unmeasured = attrs.evolve(cal, scale=1.0)  # a table made without inputs gets its scale once they come
    assert calibrate_training(g, "cpu", calibration=unmeasured, inputs=[*params["layers"], x]).scale != 1.0
    plain = CostModel(get_device("cpu"), LINKS["loopback"], attrs.evolve(cal, scale=1.0))
    scaled = CostModel(get_device("cpu"), LINKS["loopback"], attrs.evolve(cal, scale=2.0))
    e = g.eqns[0]
    assert scaled.eqn_time(e) == pytest.approx(2 * plain.eqn_time(e))
    # in a backward program (B, W, and the accumulation that W ends with) a calibrated time takes the backward scale
    assert scaled.eqn_time(e, backward=True) == pytest.approx(cal.backward_scale * cal.times[signature(e)])
    acc = accumulate_signature(g.inputs[0].aval)
    assert scaled.accumulate_time(g.inputs[0].aval) == pytest.approx(cal.backward_scale * cal.times[acc])
    unknown = CostModel(get_device("cpu"), LINKS["loopback"], Calibration("cpu", {}, scale=3.0, backward_scale=5.0))
    roofline = CostModel(get_device("cpu"), LINKS["loopback"])
    assert unknown.eqn_time(e) == unknown.eqn_time(e, backward=True) == roofline.eqn_time(e)  # no scale of either


def test_weight_grad_accumulation_is_charged_to_w() -> None:
    """Every microbatch adds each weight grad into its accumulator: W's time includes 3 x bytes / bandwidth
    per float param leaf (read grad and accumulator, write accumulator) on the roofline."""
    from engine.planning.stage_costs import exact

    params = {"layers": [torch.randn(64, 64) for _ in range(2)]}
    g = _graph(_mlp, params, torch.randn(32, 64))
    model = CostModel(get_device("h100"), LINKS["nvlink"])
    (stage,) = exact(g, [], model)
    w_graph = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs))).backward_weight.graph
    per_leaf = model.device.launch_overhead + 3 * 64 * 64 * 4 / model.device.bandwidth
    assert stage.backward_weight == pytest.approx(model.graph_time(w_graph) + 2 * per_leaf)


def test_the_backward_scale_reaches_calibrated_ops_only() -> None:
    """W's calibrated ops at the backward program scale (here 2); an op the table lacks, and the accumulations
    (not in this table), at their roofline times, unscaled: the backward over forward ratio used to multiply all
    of B and W, roofline times too."""
    from engine.planning.calibration import calibrate, signature
    from engine.planning.stage_costs import exact

    params = {"layers": [torch.randn(64, 64) for _ in range(2)]}
    g = _graph(_mlp, params, torch.randn(32, 64))
    w_graph = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs))).backward_weight.graph
    costly = [e for e in w_graph.eqns if ir.eqn_cost(e).flops or ir.eqn_cost(e).bytes]
    times = dict(calibrate(w_graph, "cpu", repeats=1, calibration=calibrate(g, "cpu", repeats=1)).times)
    left_out = costly[0]
    del times[signature(left_out)]
    model = CostModel(get_device("h100"), LINKS["nvlink"], Calibration("cpu", times, scale=1.0, backward_scale=2.0))
    roofline = CostModel(get_device("h100"), LINKS["nvlink"])
    expected = sum(2.0 * times[signature(e)] if signature(e) in times else roofline.eqn_time(e) for e in costly)
    expected += roofline.params_accumulate_time(g, range(g.num_params))
    (stage,) = exact(g, [], model)
    assert stage.backward_weight == pytest.approx(expected, rel=1e-12)
    assert len(costly) >= 2 and model.calibrated(costly[1]) and not model.calibrated(left_out)


def test_a_program_too_large_for_the_device_leaves_the_scale_at_one(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import engine.planning.calibration as calibrate_module

    params = {"layers": [torch.randn(64, 64) for _ in range(2)]}
    x = torch.randn(32, 64)
    g = _graph(_mlp, params, x)

    def out_of_memory(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    cal = calibrate_module.calibrate(g, "cpu", repeats=1)
    monkeypatch.setattr(calibrate_module.ir, "compile_graph", out_of_memory)
    ad = ir.stage_autodiff(g, constant=range(g.num_params, len(g.inputs)))
    inputs = [*params["layers"], x]
    assert calibrate_module.program_scale(ad, g, torch.device("cpu"), cal, inputs) == calibrate_module.ProgramScale()


def _as_if_on_cuda(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The launch measurement's CUDA-only parts run on the CPU: its device counts as launch-bound, syncs are no-ops."""
    from engine.planning import calibration as calmod

    monkeypatch.setattr(calmod, "_launch_bound_device", lambda device: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_launch_ratios_are_measured_per_compiler_saved_and_selected(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a device whose host runs ahead (CUDA), the whole forward and backward programs are also launched from an
    idle device: launch / run per compiler, kept in the table and given by `for_compiler(name).launch`; a table
    from before them stays as it is (its plans model no host: measuring would compile the whole model again)."""
    from engine.planning import calibration as calmod

    _as_if_on_cuda(monkeypatch)
    params = {"layers": [torch.randn(64, 64) for _ in range(3)]}
    x = torch.randn(32, 64)
    g, inputs = _graph(_mlp, params, x), [*params["layers"], x]
    cal = calmod.calibrate_training(g, "cpu", repeats=3, inputs=inputs, compiled={"fx2": ir.compile_graph})
    assert set(cal.launches) == {"fx", "fx2"}
    assert all(0.05 < r < 50 for pair in cal.launches.values() for r in pair)  # on CPU the launch is the run
    path = tmp_path / "cal.json"
    cal.save(path)
    assert Calibration.load(path) == cal
    assert cal.for_compiler("fx2").launch == cal.launches["fx2"] and cal.for_compiler("fx").launch == cal.launches["fx"]
    again = calmod.calibrate_training(g, "cpu", calibration=cal, inputs=inputs, compiled={"fx2": ir.compile_graph})
    assert again is cal
    older = attrs.evolve(cal, launches={})
    assert calmod.calibrate_training(g, "cpu", calibration=older, inputs=inputs, compiled={"fx2": ir.compile_graph}) \
        is older and older.for_compiler("fx2").launch is None


def test_no_launch_is_measured_where_the_host_runs_the_program() -> None:
    from engine.planning import calibration as calmod

    params = {"layers": [torch.randn(16, 16) for _ in range(2)]}
    x = torch.randn(8, 16)
    g = _graph(_mlp, params, x)
    cal = calmod.calibrate_training(g, "cpu", repeats=2, inputs=[*params["layers"], x])
    assert cal.launches == {} and cal.launch is None
    assert calmod._complete(cal, ir.program_digest(g), True, {})


def test_the_planners_host_follows_the_calibrated_launch_ratios() -> None:
    """Programs launched in half their time: the planner's prediction is the device's. Launched in three times their
    time: each rank follows its host, the step at least the busiest rank's launches."""
    from engine.planning.search import search
    from tests.engine.test_footprint import _mlp as mlp

    fn, params, x, y = mlp()
    base = search(fn, params, x, y, world_size=2, schedule="1f1b", microbatches=4, device="cpu")
    cal = Calibration("cpu", {})

    def planned(launch):  # type: ignore[no-untyped-def]
        table = attrs.evolve(cal, launches={"fx": launch})
        return search(fn, params, x, y, world_size=2, schedule="1f1b", microbatches=4, device="cpu",
                      cuts=base.plan.cuts, calibration=table).plan

    plain = search(fn, params, x, y, world_size=2, schedule="1f1b", microbatches=4, device="cpu",
                   cuts=base.plan.cuts, calibration=cal).plan
    assert planned((0.5, 0.5)).predicted_step_time == pytest.approx(plain.predicted_step_time, rel=1e-12)
    slow = planned((3.0, 3.0))
    busiest = max(4 * 3.0 * (s.forward_time + s.backward_input_time + s.backward_weight_time) for s in slow.stages)
    assert slow.predicted_step_time >= busiest * (1 - 1e-9) > plain.predicted_step_time


def test_a_new_scale_without_a_launch_drops_the_older_launch_ratio() -> None:
    """fx's launch ratio belongs to the program scale it was measured with: a new scale measured without one (off
    CUDA, or a program that could not run) leaves none, not the older one; other compilers' ratios stay."""
    from engine.planning.calibration import ProgramScale

    cal = Calibration("cuda", {}, launches={"fx": (1.2, 0.8), "inductor": (0.5, 0.4)})
    assert cal.with_scale(ProgramScale(1.1, 1.3)).launches == {"inductor": (0.5, 0.4)}
    assert cal.with_scale(ProgramScale(1.1, 1.3, (0.9, 0.7))).launches == {"fx": (0.9, 0.7), "inductor": (0.5, 0.4)}


def test_with_cuda_graphs_the_planner_costs_no_launches(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import importlib

    par = importlib.import_module("engine.parallelize")  # the module: `engine.parallelize` is also its function
    cal = Calibration("cuda", {}, compiled={"inductor": 1.0}, compiled_backward={"inductor": 1.0},
                      launches={"inductor": (1.5, 1.2)})
    cuda = torch.device("cuda")
    monkeypatch.setattr(par, "graphs_enabled", lambda device: False)
    assert par.costed_as_run(cal, "inductor", cuda).launch == (1.5, 1.2)
    monkeypatch.setattr(par, "graphs_enabled", lambda device: True)
    assert par.costed_as_run(cal, "inductor", cuda).launch is None
