"""ir.check: well-formed graphs pass; malformed ones raise IRError showing the equations around the failure."""
from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from ir_cases import examples, trace_case

import ir
from engine.testing import models

MM, RELU, ADD = "aten.mm.default", "aten.relu.default", "aten.add.Tensor"


def var(*shape, dtype=torch.float32):
    return ir.Var(ir.AbstractValue(shape, dtype))


def eqn(op, args, outputs):
    return ir.Eqn(op, tuple(args), (), tuple(outputs))


def good_graph():
    """a:[4,4] b:[4,4] -> c = mm a b; d = relu c; e = add c d; f = mm e b; g = relu f -> (g)."""
    a, b, c, d, e, f, g = (var(4, 4) for _ in range(7))
    eqns = [eqn(MM, [a, b], [c]), eqn(RELU, [c], [d]), eqn(ADD, [c, d], [e]), eqn(MM, [e, b], [f]),
            eqn(RELU, [f], [g])]
    return ir.Graph((a, b), tuple(eqns), (g,), ("w", "x"), 1)


def with_eqn(g, i, new):
    return attrs.evolve(g, eqns=g.eqns[:i] + (new,) + g.eqns[i + 1:])


def test_good_graph_passes_and_prints():
    g = good_graph()
    ir.check(g)
    assert str(g).splitlines()[2] == "    d:f32[4,4] = relu c"


def _expect(g, i, message):
    """IRError naming eqn i, with the `>>` marker on eqn i's line and the lines around it."""
    with pytest.raises(ir.IRError) as info:
        ir.check(g)
    text = str(info.value)
    assert f"equation {i}: " in text and message in text, text
    marked = [ln for ln in text.splitlines() if ln.lstrip().startswith(">>")]
    assert len(marked) == 1 and f"{i:4d}: " in marked[0], text
    assert len(text.splitlines()) == 1 + min(len(g.eqns), i + 3) - max(0, i - 2), text  # 2 eqns either side
    return marked[0]


def test_use_before_define():
    g = good_graph()
    d, e = g.eqns[1].outputs[0], g.eqns[2].outputs[0]
    bad = with_eqn(g, 1, eqn(RELU, [e], [d]))  # reads e, which eqn 2 defines
    line = _expect(bad, 1, "uses a variable before it is defined")
    assert line.rstrip().endswith("d:f32[4,4] = relu e")


def test_redefinition():
    g = good_graph()
    c = g.eqns[0].outputs[0]
    bad = with_eqn(g, 3, eqn(MM, [g.eqns[2].outputs[0], g.inputs[1]], [c]))  # defines c a second time
    line = _expect(bad, 3, "redefines a variable")
    assert line.rstrip().endswith("c:f32[4,4] = mm e b")


def test_redefining_an_input():
    g = good_graph()
    bad = with_eqn(g, 2, eqn(ADD, [g.eqns[0].outputs[0], g.eqns[1].outputs[0]], [g.inputs[0]]))
    _expect(bad, 2, "redefines a variable")


@pytest.mark.parametrize("out, shown", [(var(4, 5), "f32[4,5]"), (var(4, 4, dtype=torch.float64), "f64[4,4]")])
def test_wrong_declared_output_type(out, shown):
    g = good_graph()
    bad = with_eqn(g, 2, eqn(ADD, [g.eqns[0].outputs[0], g.eqns[1].outputs[0]], [out]))
    bad = attrs.evolve(bad, eqns=bad.eqns[:3])
    bad = attrs.evolve(bad, outputs=(out,))
    line = _expect(bad, 2, f"output declared {shown} but aten.add.Tensor gives f32[4,4]")
    assert f"e:{shown} = add.Tensor c d" in line


def test_operand_types_rejected():
    g = good_graph()
    a, wide = g.inputs[0], var(3, 7)
    bad = attrs.evolve(g, inputs=(a, g.inputs[1], wide), input_names=("w", "x", "z"),
                       eqns=(g.eqns[0], eqn(MM, [g.eqns[0].outputs[0], wide], [var(4, 7)])))
    bad = attrs.evolve(bad, outputs=(bad.eqns[1].outputs[0],))
    line = _expect(bad, 1, "aten.mm.default rejects its operand types")
    assert line.rstrip().endswith("e:f32[4,7] = mm d c")


@pytest.mark.parametrize("op", ["aten.frobnicate.default", "aten.relu.nosuchoverload", "relu"])
def test_unknown_op(op):
    g = good_graph()
    bad = with_eqn(g, 1, eqn(op, [g.eqns[0].outputs[0]], [g.eqns[1].outputs[0]]))
    line = _expect(bad, 1, f"unknown op {op!r}")
    assert "d:f32[4,4] = " in line


def test_output_never_defined():
    g = good_graph()
    bad = attrs.evolve(g, outputs=(var(4, 4),))
    _expect(bad, len(g.eqns) - 1, "graph output is never defined")


def test_structure_errors():
    g = good_graph()
    with pytest.raises(ir.IRError, match="2 input names for 3 inputs"):
        ir.check(attrs.evolve(g, inputs=(*g.inputs, var(1))))
    with pytest.raises(ir.IRError, match="listed twice"):
        ir.check(attrs.evolve(g, inputs=(g.inputs[0], g.inputs[0]), input_names=()))
    with pytest.raises(ir.IRError, match="num_params=3"):
        ir.check(attrs.evolve(g, num_params=3))


def test_types_false_skips_op_checks():
    g = good_graph()
    ir.check(with_eqn(g, 1, eqn("aten.frobnicate.default", [g.eqns[0].outputs[0]], [g.eqns[1].outputs[0]])),
             types=False)


@settings(max_examples=examples(15))
@given(models(dtypes=(torch.float32, torch.bfloat16), max_layers=8))
def test_traced_stage_and_part_graphs_check(case):
    g = trace_case(case)
    ir.check(g)
    for stage in ir.split(g, [len(g.eqns) // 2] if len(g.eqns) > 1 else []):
        ir.check(stage.graph)
        ad = ir.stage_autodiff(stage.graph, constant=range(stage.graph.num_params,
                                                          stage.graph.num_params + len(stage.batch_ids)))
        for part in (ad.forward, ad.backward_input, ad.backward_weight):
            ir.check(part.graph)
