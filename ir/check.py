"""`ir.check`: structural and type validation of a graph, with the equations around a failure."""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .core import AbstractValue, Eqn, Graph, Literal, Var
from .errors import IRError
from .printer import Namer, format_eqn
from .purify import resolve


def _context(g: Graph, i: int, namer: Namer, radius: int = 2) -> str:
    lines = []
    for j in range(max(0, i - radius), min(len(g.eqns), i + radius + 1)):
        mark = ">>" if j == i else "  "
        lines.append(f"  {mark} {j:4d}: {format_eqn(g.eqns[j], namer)}")
    return "\n".join(lines)


def _fail(g: Graph, i: int, msg: str) -> IRError:
    namer = Namer()
    for v in g.inputs:
        namer(v)
    for e in g.eqns[: max(0, i - 2)]:
        for v in e.out_vars:
            namer(v)
    return IRError(f"equation {i}: {msg}\n{_context(g, i, namer)}")


def _fake_args(e: Eqn, mode: FakeTensorMode) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def conv(x: Any) -> Any:
        if isinstance(x, Var):
            with mode:
                return torch.empty(x.aval.shape, dtype=x.aval.dtype, device=x.aval.device)
        if isinstance(x, Literal):
            return mode.from_tensor(x.value) if isinstance(x.value, torch.Tensor) else x.value
        if isinstance(x, (list, tuple)):
            return type(x)(conv(y) for y in x)
        return x

    return conv(e.args), {k: conv(v) for k, v in e.kwargs}


def _check_types(g: Graph, i: int, e: Eqn, mode: FakeTensorMode) -> None:
    try:
        op = resolve(e.op)
    except (AttributeError, ValueError) as exc:
        raise _fail(g, i, f"unknown op {e.op!r}") from exc
    args, kwargs = _fake_args(e, mode)
    try:
        with mode:
            out = op(*args, **kwargs)
    except Exception as exc:  # any failure of the op on these types is a type error
        raise _fail(g, i, f"{e.op} rejects its operand types: {str(exc).splitlines()[0]}") from exc
    outs = e.results(out) if e.multi and (not e.nested or len(out) == len(e.nested)) else out if e.multi else (out,)
    if len(outs) != len(e.outputs):
        raise _fail(g, i, f"{e.op} returns {len(outs)} values, the equation declares {len(e.outputs)}")
    for v, o in zip(e.outputs, outs):
        if v is not None and AbstractValue.of(o) != v.aval:
            raise _fail(g, i, f"output declared {v.aval} but {e.op} gives {AbstractValue.of(o)}")


def check(g: Graph, *, types: bool = True) -> None:
    """Raise IRError unless every variable is defined once before use, types agree, and outputs exist."""
    if len(g.input_names) not in (0, len(g.inputs)):
        raise IRError(f"{len(g.input_names)} input names for {len(g.inputs)} inputs")
    if not 0 <= g.num_params <= len(g.inputs):
        raise IRError(f"num_params={g.num_params} but the graph has {len(g.inputs)} inputs")
    defined: set[Var] = set()
    for v in g.inputs:
        if v in defined:
            raise IRError("an input variable is listed twice")
        defined.add(v)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for i, e in enumerate(g.eqns):
        for v in e.inputs:
            if v not in defined:
                raise _fail(g, i, "uses a variable before it is defined")
        for v in e.out_vars:
            if v in defined:
                raise _fail(g, i, "redefines a variable (each variable is defined exactly once)")
            defined.add(v)
        if types:
            _check_types(g, i, e, mode)
    for v in g.outputs:
        if isinstance(v, Var) and v not in defined:
            raise _fail(g, len(g.eqns) - 1, "graph output is never defined")
