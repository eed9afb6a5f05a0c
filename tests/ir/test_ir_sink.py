"""ir.sink: equations that read only params move to their first consumer, so a stage cut does not turn them
into activations sent every microbatch."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import ir
from ir.sink import sink_input_ops


def _loss(params: dict, x: torch.Tensor) -> torch.Tensor:
    bufs = {k: v.detach() for k, v in params["buffers"].items()}  # what engine.functionalize does up front
    h = x
    for i in range(4):
        h = torch.tanh(h @ params["w"][i] + bufs[f"b{i}"])
    return h.square().mean()


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": [torch.randn(6, 6, generator=g, dtype=torch.float64) for _ in range(4)],
            "buffers": {f"b{i}": torch.randn(6, generator=g, dtype=torch.float64) for i in range(4)}}


def _first_reader(g: ir.Graph, name: str) -> int:
    v = g.inputs[list(g.input_names).index(name)]
    return min(i for i, e in enumerate(g.eqns) if v in e.inputs)


def test_a_detached_buffer_moves_next_to_the_layer_that_reads_it() -> None:
    x = torch.randn(5, 6, dtype=torch.float64)
    g = ir.trace(_loss, _params(), x)
    for i in range(4):
        at = _first_reader(g, f"buffers.b{i}")
        assert g.eqns[at].op == "aten.detach.default"
        consumer = next(j for j, e in enumerate(g.eqns) if g.eqns[at].outputs[0] in e.inputs)
        assert consumer == at + 1  # right before its add, not at the top of the graph
    assert _first_reader(g, "buffers.b3") > _first_reader(g, "w.2")


def test_sinking_keeps_the_values_and_a_topological_order() -> None:
    x = torch.randn(5, 6, dtype=torch.float64)
    params = _params()
    g = ir.trace(_loss, params, x)
    again = sink_input_ops(g)
    assert [e.op for e in again.eqns] == [e.op for e in g.eqns]  # idempotent
    seen = set(g.inputs)
    for e in g.eqns:
        assert all(v in seen for v in e.inputs)
        seen.update(e.out_vars)
    assert torch.equal(ir.evaluate(g, params, x), _loss(params, x))


def test_a_cut_sends_only_activations_not_the_other_stages_buffers() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU())]).double()
    fn, variables = engine.functionalize(net.eval(), loss=F.mse_loss)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    g = ir.trace(fn, variables, x, y)
    for cut in range(1, len(g.eqns)):
        sent = ir.split(g, [cut])[0].acts_out
        assert len(sent) <= 3, (cut, g.eqns[cut].op)  # inside a layer: its input and its two buffers at most
        if g.eqns[cut - 1].op == "aten.relu.default":
            assert len(sent) == 1  # between layers: the hidden state alone (unsunk: every later layer's buffers)
