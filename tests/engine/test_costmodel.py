"""Cost model (roofline, links, calibration, backward estimates), memory model, and block coarsening."""
from __future__ import annotations

import pytest
import torch

import ir
import schedules
from engine.blocks import coarsen, crossing_bytes, module_cuts
from engine.calibrate import Calibration, calibrate, signature
from engine.costmodel import CostModel, backward_estimates
from engine.devices import H100, H200, LINKS, get_device, get_link
from engine.errors import PlanError
from engine.memory import MemoryModel, StageMemory, peak_live, rank_peaks, stage_peaks
from engine.stagecost import transient_bytes
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


def _one_f_one_b(p: int, m: int) -> schedules.Table:
    return schedules.get("1f1b")(p, m)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 2), (3, 5)])
def test_peak_live_matches_the_analytic_limits(p: int, m: int) -> None:
    assert peak_live(_one_f_one_b(p, m)) == tuple(min(m, p - r) for r in range(p))
    assert peak_live(schedules.get("gpipe")(p, m)) == (m,) * p


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1", "zbv", "interleaved-1f1b"])
def test_rank_peaks_agree_with_the_simulator(name: str) -> None:
    stages = 8 if name in ("zbv", "interleaved-1f1b") else 4
    table = schedules.get(name)(stages, 8)
    mems = [StageMemory(100.0 * s + 10, 7.0 + s, 3.0 * (s % 2)) for s in range(stages)]
    model = MemoryModel(margin=0.1)
    costs = schedules.Costs(memory_per_microbatch=tuple(m.per_microbatch for m in mems),
                            memory_b_to_w=tuple(m.b_to_w for m in mems),
                            static_memory=tuple(sum(mems[s].static for s in table.stages_of(r))
                                                for r in range(table.num_ranks)))
    sim = schedules.simulate(table, costs)
    assert rank_peaks(table, mems, model) == pytest.approx([x * 1.1 for x in sim.peak_memory])
    alone = stage_peaks(table, mems, model)
    assert all(alone[s] <= rank_peaks(table, mems, model)[table.rank_of(s)] + 1e-9 for s in range(stages))


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
    from engine.calibrate import signature

    out = _ir.Var(_ir.AbstractValue((4,), torch.float32, "cuda:0"))
    make = lambda index: _ir.Eqn("aten.zeros.default", ([4],), (("device", torch.device("cuda", index)),), (out,))  # noqa: E731
    assert signature(make(0)) == signature(make(1))
