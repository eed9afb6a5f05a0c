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
from engine.planning import candidates as candidates_mod
from engine.planning.artifacts import Workshop, autodiff
from engine.planning.blocks import coarsen
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
    (joint,) = shop._stitched.values()
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
