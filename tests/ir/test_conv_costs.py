"""Convolution, batch norm and pooling costs: FLOPs by formula, a backward that costs about two forwards."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import engine
from engine.planning.artifacts import Workshop
from engine.planning.devices import get_device, get_link
from engine.planning.op_costs import CostModel
from ir.costs import eqn_cost


def _stage(net: nn.Module, x: torch.Tensor, grad_input: bool = False) -> tuple:
    fn, variables = engine.functionalize(net, loss=lambda o: o.pow(2).mean())
    shop = Workshop(fn, variables, (x,))
    graph = shop.graph(x.shape[0])
    return graph, shop.stages(x.shape[0], [])[0].ad


def _ops(graph: object, name: str) -> list:
    return [e for e in graph.eqns if e.op.split(".")[1] == name]


def test_convolution_forward_and_backward_flops() -> None:
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1,
                                                                          bias=False)).eval()
    graph, ad = _stage(net, torch.randn(4, 3, 16, 16))
    first, second = (eqn_cost(e).flops for e in _ops(ad.forward.graph, "convolution"))
    assert first == 2 * (4 * 16 * 16 * 16) * (3 * 9) + 4 * 16 * 16 * 16   # 2 x out x in x k^2, + bias
    assert second == 2 * (4 * 32 * 8 * 8) * (16 * 9)
    backs = {tuple(e.args[10]): eqn_cost(e).flops for e in _ops(ad.backward.graph, "convolution_backward")}
    assert backs[(True, True, False)] == 2 * second           # input and weight grads: two products
    assert backs[(False, True, True)] == first               # the first conv: weight grad + bias sum only


def test_batch_norm_in_train_mode_reads_its_input_twice() -> None:
    x = torch.randn(8, 4, 6, 6)
    train, _ = _stage(nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, track_running_stats=False)).train(), x)
    evals, _ = _stage(nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)).eval(), x)
    t, e = (eqn_cost(_ops(g, "batch_norm")[0]) for g in (train, evals))
    assert t.bytes_read - e.bytes_read == x.numel() * 4 - 2 * 4 * 4  # a second pass; no running stats read
    assert t.flops == 5 * x.numel() and e.flops == 2 * x.numel()


def test_a_resnet_block_backward_is_predicted_near_two_forwards() -> None:
    """The issue's symptom: a conv stage's backward was predicted at 1.1-1.5x its forward."""
    w = 64
    block = nn.Sequential(nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                          nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
    net = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), block).eval()
    x = torch.randn(32, 3, 32, 32, device="meta")
    _, ad = _stage(net, x)
    model = CostModel(get_device("h100"), get_link(None, get_device("h100")))
    fwd = model.graph_time(ad.forward.graph)
    bwd = model.graph_time(ad.backward_input.graph) + model.graph_time(ad.backward_weight.graph)
    assert 1.7 < bwd / fwd < 2.3, (fwd, bwd)


@pytest.mark.parametrize("op", ["max_pool2d", "avg_pool2d"])
def test_pooling_costs_a_comparison_per_kernel_element(op: str) -> None:
    pool = nn.MaxPool2d(3, 2, 1) if op == "max_pool2d" else nn.AvgPool2d(3, 2, 1)
    graph, _ = _stage(nn.Sequential(nn.Conv2d(2, 2, 1), pool).eval(), torch.randn(2, 2, 8, 8))
    assert eqn_cost(_ops(graph, op)[0]).flops == 2 * 2 * 4 * 4 * 9
