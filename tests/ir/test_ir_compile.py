"""ir.compile_graph: fx's generated program with its op overloads' calls bound to their builtins (`bound_ops`)."""
from __future__ import annotations

import re
import traceback

import pytest
import torch

import ir
from ir.compile import bound_ops


def _model(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.layer_norm(x, (4,), p["w"], None)
    q, k = (h @ p["m"]).chunk(2, dim=-1)  # a multi-output op: fx's getitems
    return (q * k).sum() + torch.tensor(2.0, dtype=x.dtype) * x.mean()  # a constant: a module buffer


def _graph() -> tuple[ir.Graph, list[torch.Tensor]]:
    p = {"w": torch.rand(4, dtype=torch.float64), "m": torch.randn(4, 8, dtype=torch.float64)}
    x = torch.randn(3, 4, dtype=torch.float64)
    return ir.trace(_model, p, x), [p["w"], p["m"], x]


def test_the_program_is_fxs_code_with_each_op_call_renamed_and_computes_the_same() -> None:
    """Its code is fx's, line for line (so each value is freed after its last use exactly where fx frees it),
    but for the op calls; no `torch.ops.` lookup is left; the outputs are fx's, bit for bit."""
    g, inputs = _graph()
    gm = ir.to_fx(g)
    fn = ir.compile_graph(g)
    assert fn.__self__ is not gm and isinstance(fn.__self__, torch.fx.GraphModule)
    code = fn.__func__.__code__
    source = "".join(__import__("linecache").getlines(code.co_filename))
    assert "torch.ops." not in source and "torch.ops.aten.layer_norm.default(" in gm.code
    assert source == re.sub(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(", r"_op_\1_\2_\3(", gm.code)
    assert code.co_names.count("_op_aten_mul_Tensor") == 1 and "_op_aten_mul_Tensor" in fn.__func__.__globals__
    assert fn.__func__.__globals__["_op_aten_mul_Tensor"] is torch.ops.aten.mul.Tensor._op
    want, got = gm(*inputs), fn(*inputs)
    assert len(want) == len(got) == 1 and torch.equal(want[0], got[0])
    torch.testing.assert_close(got[0], _model({"w": inputs[0], "m": inputs[1]}, inputs[2]), rtol=1e-12, atol=0)


def test_accumulated_outputs_are_added_in_place_as_fx_adds_them() -> None:
    g, inputs = _graph()
    acc_fx, acc = torch.ones(()), torch.ones(())
    out_fx, out = ir.to_fx(g, (0,))(*inputs, acc_fx), ir.compile_graph(g, (0,))(*inputs, acc)
    assert out_fx == out == (None,) and torch.equal(acc, acc_fx) and acc.item() != 1.0


def test_a_failing_op_names_its_line_of_the_program() -> None:
    g, inputs = _graph()
    fn = bound_ops(ir.to_fx(g))
    with pytest.raises(RuntimeError) as err:
        fn(inputs[0], torch.randn(5, 8, dtype=torch.float64), inputs[2])  # m of the wrong shape
    frames = [f for f in traceback.extract_tb(err.value.__traceback__) if f.filename.startswith("<fnpipe program")]
    assert len(frames) == 1 and "_op_aten_matmul_default(" in frames[0].line


def test_a_programs_source_is_kept_for_tracebacks_while_the_program_lives() -> None:
    import gc
    import linecache

    g, _ = _graph()
    fn = bound_ops(ir.to_fx(g))
    filename = fn.__func__.__code__.co_filename
    assert linecache.getlines(filename) and filename in linecache.cache
    del fn
    gc.collect()
    assert filename not in linecache.cache
