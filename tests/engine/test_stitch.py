"""Stage joints stitched from their blocks' joints (ir.stitch, Workshop.costing) against the joints traced
for the whole stage: the same numbers, the same stage costs, the same plans."""
from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import ir
from ir import stitch
from engine.planning import candidates as candidates_mod
from engine.planning.artifacts import Workshop, autodiff
from engine.planning.blocks import coarsen, crossing_bytes, module_cuts
from engine.planning.calibration import Calibration, accumulate_signature, ops_sums, signature
from engine.planning.devices import get_device, get_link
from engine.planning.op_costs import CostModel
from engine.planning.stage_costs import _exact_stage
from examples.resnet_model import Bottleneck

D, LAYERS = 8, 4
REL = 1e-12  # stage times are sums of the same per-op times, added in another order


def _mlp() -> tuple[Any, Any, tuple[torch.Tensor, ...], bool]:
    """Residual layers with a skip over all of them and a tied head: values read by several blocks."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    params = {"emb": r(D, D), "layers": [{"w1": r(D, 2 * D), "w2": r(2 * D, D), "g": r(D)} for _ in range(LAYERS)]}

    def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = h0 = x @ p["emb"]
        for layer in p["layers"]:
            h = h + torch.tanh(F.layer_norm(h, (D,), layer["g"]) @ layer["w1"]) @ layer["w2"]
        return (((h + h0) @ p["emb"].T - y) ** 2).mean()

    return loss_fn, params, (r(6, D), r(6, D)), False


def _resnet(train: bool) -> tuple[Any, Any, tuple[torch.Tensor, ...], bool]:
    """A stem and three bottlenecks (examples/resnet_model.py's, the first with a downsample): BatchNorm's
    buffers ride along every stage; in train mode its new running statistics are aux outputs carried to
    the end."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                        Bottleneck(8, 4, 2), Bottleneck(16, 4, 1), Bottleneck(16, 4, 1),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    fn, variables = engine.functionalize(net.double().train(train), loss=F.cross_entropy)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (4,))
    return fn, variables, (x, y), train


MODELS = {"mlp": _mlp, "resnet-eval": lambda: _resnet(False), "resnet-train": lambda: _resnet(True)}


def _setup(name: str, calibrated: bool = False) -> tuple[Workshop, ir.Graph, CostModel, tuple[int, ...]]:
    fn, params, batch, aux = MODELS[name]()
    shop = Workshop(fn, params, batch, has_aux=aux)
    g = shop.graph(2)
    cpu = get_device("cpu")
    model = CostModel(cpu, get_link(None, cpu), _table(g, shop) if calibrated else None)
    return shop, g, model, coarsen(g, model, fine=True).bounds


def _table(g: ir.Graph, shop: Workshop) -> Calibration:
    """A calibration table of every op signature the traced stage programs of `g` have, at every cut and level,
    each a different time far above the roofline's: an equation of a stitched program that prints unlike its
    traced twin finds no time and is costed by the roofline instead."""
    bounds = coarsen(g, CostModel(get_device("cpu"), get_link(None, get_device("cpu")))).bounds
    keys: set[str] = set()
    for cuts in [(), *_cut_sets(bounds)]:
        for stage, level in itertools.product(ir.split(g, cuts), (False, "cheap", True)):
            ad = shop.autodiff(2, stage, level)
            keys |= {signature(e) for part in (ad.forward, ad.backward_input, ad.backward_weight, ad.backward)
                     for e in part.graph.eqns}
    return Calibration("cpu", {k: 1e-3 * (1 + int(k[:4], 16) % 7) for k in sorted(keys)}, scale=1.1,
                       backward_scale=0.9)


def _cut_sets(bounds: tuple[int, ...]) -> list[tuple[int, ...]]:
    inner = bounds[1:-1]
    mid = len(inner) // 2
    return [(inner[mid],), (inner[1], inner[-2]), tuple(inner[:: max(1, len(inner) // 4)])]


@pytest.mark.parametrize("calibrated", [False, True], ids=["roofline", "calibrated"])
@pytest.mark.parametrize("name", list(MODELS))
def test_stitched_stage_costs_equal_the_traced_ones(name: str, calibrated: bool) -> None:
    """Every StageCost field (times, flops, saved / handed-over / workspace bytes) at every recompute level,
    costed by the roofline and by a calibration table (keyed by op signature: the stitched programs' ops must
    print as the traced ones do, kwargs included)."""
    shop, g, model, bounds = _setup(name, calibrated)
    checked, joints = 0, {}  # the reference traces each stage's joint once for its three levels
    for cuts in _cut_sets(bounds):
        for stage, level in itertools.product(ir.split(g, cuts), (False, "cheap", True)):
            stitched = _exact_stage(g, stage, model, lambda s, r: shop.costing(2, s, r, bounds), level)
            traced = _exact_stage(g, stage, model, lambda s, r: autodiff(s, r, device="cpu", joints=joints), level)
            got, want = attrs.asdict(stitched), attrs.asdict(traced)
            for key, value in want.items():
                if isinstance(value, float):
                    assert got[key] == pytest.approx(value, rel=REL, abs=1e-30), (cuts, stage.index, level, key)
                else:
                    assert got[key] == value, (cuts, stage.index, level, key)
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize("name", list(MODELS))
def test_stitched_joint_computes_the_traced_joint(name: str) -> None:
    """The stitched joint graph run on random float64 inputs and cotangents: outputs and every grad equal the
    traced joint's (the traced one is checked against torch.func.grad in tests/ir)."""
    shop, g, _, bounds = _setup(name)
    stage = ir.split(g, (bounds[len(bounds) // 2],))[1 if name == "mlp" else 0]
    shop.costing(2, stage, False, bounds)
    (found,) = shop._stitched.own.values()
    joint = found.joint
    traced = ir.autodiff._trace_joint(stage.graph, *_diff(stage), "cpu")
    assert len(joint.inputs) == len(traced.inputs) and len(joint.outputs) == len(traced.outputs)
    gen = torch.Generator().manual_seed(1)
    args = [torch.rand(v.aval.shape, generator=gen, dtype=v.aval.dtype) + 0.5 if v.aval.dtype.is_floating_point
            else torch.zeros(v.aval.shape, dtype=v.aval.dtype) for v in traced.inputs]
    for got, want in zip(ir.interpret(joint, args), ir.interpret(traced, args)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _diff(stage: ir.Stage) -> tuple[list[int], list[int]]:
    from engine.planning.artifacts import stage_constants

    return ir.autodiff.diff_positions(stage.graph, *stage_constants(stage))


@pytest.mark.parametrize("options", [
    dict(world_size=2, stages="auto", dp="auto", microbatches="auto", memory_limit=28_000, recompute="auto"),
    dict(world_size=2, stages=2, microbatches=2, recompute=True, schedule="zb-h1")])
def test_plans_equal_with_traced_costing(monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]) -> None:
    """The planner's choice and every number of the plan do not depend on how candidate stages are differentiated."""
    fn, params, batch, _ = _mlp()
    stitched = engine.plan(fn, params, *batch, **options)
    monkeypatch.setattr(candidates_mod.Candidates, "differentiate",
                        lambda self, size: lambda stage, level: self.workshop.autodiff(size, stage, level))
    traced = engine.plan(fn, params, *batch, **options)
    assert stitched == traced


def test_a_calibrated_one_stage_plan_costs_the_programs_its_scales_measured() -> None:
    """A calibration's scales are the whole model's forward and fused backward programs over their ops' (and
    accumulations') sums, so a one-stage plan of that model costs them at exactly scale x those sums. The search
    prices stitched programs (ir.stitch): a stitched equation the table lacks would take the roofline's price
    instead (ResNet-101x4's BatchNorm zeros did, 3.2-3.4 % of its backward on an H100, until 45128ba)."""
    fn, params, batch, aux = _resnet(True)
    shop = Workshop(fn, params, batch, has_aux=aux)
    g = shop.graph(2)
    table = _table(g, shop)
    whole = autodiff(ir.split(g, [])[0], False, device="cpu")
    accumulations = {accumulate_signature(g.inputs[p].aval): 2e-4 for p in range(g.num_params)
                     if g.inputs[p].aval.dtype.is_floating_point}
    table = attrs.evolve(table, times={**table.times, **accumulations})
    sums = ops_sums(whole, g, table)
    assert sums.missing == 0 and sums.accumulate
    plan = engine.plan(fn, params, *batch, schedule="1f1b", microbatches=2, has_aux=True, calibration=table,
                       min_microbatch_size=1, recompute=False)
    (stage,) = plan.stages
    assert stage.forward_time == pytest.approx(table.scale * sums.forward, rel=1e-9)
    backward = stage.backward_input_time + stage.backward_weight_time
    assert backward == pytest.approx(table.backward_scale * sums.backward, rel=1e-9)


def _aux_first_layer(p, x, y):  # type: ignore[no-untyped-def]
    h1 = torch.tanh(x @ p["ws"][0])
    metric = h1.abs().sqrt().mean()  # an aux value made in the first block: nothing differentiates it
    h = h1
    for w in p["ws"][1:]:
        h = torch.tanh(h @ w)
    return torch.nn.functional.mse_loss(h @ p["w3"], y), metric


def _aux_params() -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) / s[0] ** 0.5  # noqa: E731
    params = {"ws": [r(8, 8) for _ in range(6)], "w3": r(8, 1)}
    x, y = r(16, 8), r(16, 1)
    x[3] = 0.0  # an all-zero row: the metric's sqrt has an infinite derivative there
    return params, x, y


def test_a_stage_whose_aux_value_is_made_before_its_last_block_runs_its_traced_joint() -> None:
    """A piece output nothing differentiates (an aux metric of the first layer) would get a zero cotangent in
    the stitched joint and its backward 0 x inf = NaN; the stage is not stitchable and runs its traced joint:
    finite grads, torch.func.grad's to 1e-10."""
    from torch.utils import _pytree as pytree


    params, x, y = _aux_params()
    shop = Workshop(_aux_first_layer, params, (x, y), has_aux=True)
    (stage,) = ir.split(shop.graph(8), ())
    bounds = tuple(sorted({0, len(stage.graph.eqns), *module_cuts(stage.graph, crossing_bytes(stage.graph))}))
    pieces = shop._pieces_in(8, bounds, stage)
    assert pieces is not None and len(pieces) > 1
    joints = [stitch.piece_joint(p, "cpu", {}) for p in pieces]
    with pytest.raises(stitch.NotStitchable):
        stitch.stitched_joint(stage, pieces, joints, *_diff(stage))
    step = engine.parallelize(_aux_first_layer, params, x, y, microbatches=2, has_aux=True)
    (loss, _), grads = step(step.shard(params), x, y)
    want, (want_loss, _) = torch.func.grad_and_value(_aux_first_layer, has_aux=True)(params, x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for got, ref in zip(pytree.tree_leaves(grads), pytree.tree_leaves(want), strict=True):
        assert bool(got.isfinite().all())
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)


def test_a_plan_cache_hit_runs_the_programs_the_search_ran(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A warm start from the plan cache builds the programs the cold search built (stitched on bounds from the
    graph and the plan's cuts alike): the cache's program fingerprints match, with per-layer aux metrics too."""
    import engine

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        h, norms = x, []
        for w in p["ws"]:
            h = torch.tanh(h @ w)
            norms.append(h.pow(2).mean())
        return torch.nn.functional.mse_loss(h @ p["w3"], y), norms

    params, x, y = _aux_params()
    losses = []
    for _ in ("cold", "warm"):
        step = engine.parallelize(loss_fn, params, x, y, microbatches=2, has_aux=True, plan_cache=tmp_path)
        (loss, _), _ = step(step.shard(params), x, y)
        losses.append(loss)
        step.close()
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


@pytest.mark.parametrize("cuts", [[7], [11]], ids=["cut-7", "cut-11"])
def test_an_aux_value_carried_over_a_cut_gets_no_grad_back(cuts: list[int]) -> None:
    """A first-layer metric (sqrt at an all-zero row) carried to the last stage, where it is aux: the receiver
    holds it constant (`ir.slicing.off_the_loss`) and sends no zeros grad back, so the sender runs no backward of
    it (0 x inf = NaN): finite grads, torch.func.grad's to 1e-10."""
    from torch.utils import _pytree as pytree

    from engine.execution.inprocess import build_steps, run_steps

    params, x, y = _aux_params()
    g = Workshop(_aux_first_layer, params, (x, y), has_aux=True).graph(8)
    stages = ir.split(g, cuts)
    assert stages[1].frozen_in and stages[0].frozen_out  # the metric: constant on both sides
    plan = engine.plan(_aux_first_layer, params, x, y, world_size=2, stages=2, cuts=cuts, microbatches=2,
                       has_aux=True, schedule="1f1b")
    got = run_steps(build_steps(_aux_first_layer, params, (x, y), plan, has_aux=True), params, (x, y))
    want, (want_loss, _) = torch.func.grad_and_value(_aux_first_layer, has_aux=True)(params, x, y)
    torch.testing.assert_close(got.loss[0], want_loss, rtol=1e-12, atol=0)
    for a, b in zip(pytree.tree_leaves(got.grads), pytree.tree_leaves(want), strict=True):
        assert bool(a.isfinite().all())
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def _gated(p, x, y):  # type: ignore[no-untyped-def]
    h, gate = x, None
    for layer in p["layers"]:
        m = (h @ layer["w"]).abs().sqrt()  # read later only through a comparison: no gradient reaches it
        if gate is not None:
            h = h * gate.to(h.dtype)
        h = torch.tanh(h @ layer["w"])
        gate = m > 0.3
    cw = (h[:, :3] > 0).to(x.dtype) + 0.5  # a weight made from a comparison: binary_cross_entropy refuses one with grad
    return F.binary_cross_entropy(torch.sigmoid(h @ p["out"]["w"]), y, weight=cw)


def test_values_only_a_comparison_reads_carry_no_grad_in_stitched_and_cut_stages() -> None:
    """A float read downstream only through a comparison, and a loss weight cast from one: no gradient reaches
    either (`no_grad_values`, `off_the_loss`), so a stitched stage traces its pieces without a grad on them and a
    cut between sends none (a zeros grad through sqrt's backward at zero was NaN, and binary_cross_entropy refused
    a weight that required grad). One stage and two, torch.func.grad's numbers."""
    from engine.testing import assert_parallel_equivalent

    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) / s[0] ** 0.5  # noqa: E731
    params = {"layers": [{"w": r(6, 6)} for _ in range(4)], "out": {"w": r(6, 3)}}
    params["layers"][0]["w"][:, 0] = 0.0
    x, y = r(8, 6), torch.rand(8, 3, generator=gen, dtype=torch.float64)
    x[2] = 0.0
    n = len(ir.trace(_gated, params, x[:4], y[:4]).eqns)
    for cuts in ([], [n // 2], [n // 3, 2 * n // 3]):
        assert_parallel_equivalent(_gated, params, x, y, cuts=cuts, stages=len(cuts) + 1, microbatches=2,
                                   rtol=1e-10, atol=1e-12)


def test_a_joint_for_a_device_this_machine_lacks_is_checked_on_meta_tensors() -> None:
    """A stitched joint traced for CUDA on a CPU-only machine (an offline tool building a GPU plan's programs) runs
    its check on the meta device, as its GPU machine runs it on CUDA, instead of being refused for the device; the
    meta kernels refuse a `view` of a transposed value as the device's do, so the check still finds that case."""
    params = {"w": torch.empty(8, 8, device="meta")}
    x = torch.empty(4, 8, device="meta")
    joint = ir.trace(lambda p, x: torch.tanh(x @ p["w"]).t().sum(), params, x, device="cuda")
    assert all(v.aval.device.startswith("cuda") for v in joint.inputs)
    assert stitch.check_runs(joint, "cuda") is joint
    with pytest.raises(RuntimeError, match="view"):
        torch.empty(4, 3, device="meta").t().view(-1)
