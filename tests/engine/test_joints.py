"""The process's traced joints: a model planned again traces none, the table stays bounded, big constants stay out."""
from __future__ import annotations

import torch

import ir
import ir.autodiff as ir_autodiff
from engine.planning import joints as joints_mod
from engine.planning.joints import JOINTS, SharedJoints
from engine.planning.search import search
from tests.mpi.passes import mlp_loss


def _planned(monkeypatch, params, x, y, **options):
    traced = []
    real = ir_autodiff._trace_joint

    def counting(*args):
        traced.append(args[0])
        return real(*args)

    monkeypatch.setattr(ir_autodiff, "_trace_joint", counting)
    found = search(mlp_loss, params, x, y, world_size=2, microbatches=4, **options)
    programs = [str(s.ad.forward) + str(s.ad.backward_input) + str(s.ad.backward_weight) for s in found.stages]
    monkeypatch.setattr(ir_autodiff, "_trace_joint", real)
    return len(traced), programs


def test_a_model_planned_again_traces_no_joint_and_runs_the_same_programs(monkeypatch) -> None:
    torch.manual_seed(0)
    params = {"layers": [torch.randn(16, 16, dtype=torch.float64) / 4 for _ in range(4)]}
    x, y = torch.randn(32, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)
    JOINTS.clear()
    first, programs = _planned(monkeypatch, params, x, y, schedule="1f1b")
    again, same = _planned(monkeypatch, params, x, y, schedule="1f1b")
    other, _ = _planned(monkeypatch, params, x, y, schedule="zb-h1")  # another schedule: the same blocks
    assert first > 0 and again == 0 and other == 0 and same == programs, (first, again, other)
    JOINTS.clear()
    assert _planned(monkeypatch, params, x, y, schedule="1f1b")[0] == first  # the count is the cache's doing


def test_the_table_keeps_the_most_recently_used_and_no_graph_with_big_constants(monkeypatch) -> None:
    def graph(const: torch.Tensor) -> ir.Graph:
        return ir.trace(lambda p, x: ((x @ const.T) * p).sum(), torch.ones(const.shape[0], dtype=const.dtype),
                        torch.ones(2, const.shape[-1], dtype=const.dtype))

    small = [graph(torch.full((1, 4), float(k))) for k in range(3)]
    table = SharedJoints(size=2)
    table["a"], table["b"] = small[0], small[1]
    assert table.get("a") is small[0]  # "a" used last: "b" goes first
    table["c"] = small[2]
    assert "b" not in table and table["a"] is small[0] and table["c"] is small[2] and len(table) == 2
    monkeypatch.setattr(joints_mod, "CONSTANT_BYTES", 1000)
    big = graph(torch.randn(200, 4, dtype=torch.float64))  # 6,400 bytes of constant
    assert joints_mod._constant_bytes(big) == 6400
    table["big"] = big
    assert table.get("big") is None and len(table) == 2
