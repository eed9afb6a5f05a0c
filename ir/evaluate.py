"""Running graphs: a reference interpreter that frees values at last use, and `evaluate` on pytrees."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from .core import Graph, Literal, Var
from .device import require_runnable
from .errors import IRError
from .purify import resolve


def _read(env: dict[Var, Any], x: Any) -> Any:
    if isinstance(x, Var):
        return env[x]
    if isinstance(x, Literal):
        return x.value
    if isinstance(x, (list, tuple)):
        return type(x)(_read(env, y) for y in x)
    return x


def interpret(g: Graph, flat_args: Sequence[Any]) -> list[Any]:
    """Run `g` on flat inputs one equation at a time; each value is dropped after its last use."""
    if len(flat_args) != len(g.inputs):
        raise IRError(f"graph takes {len(g.inputs)} inputs, got {len(flat_args)}")
    require_runnable(g)
    env: dict[Var, Any] = dict(zip(g.inputs, flat_args))
    last = g.last_use()
    for i, e in enumerate(g.eqns):
        out = resolve(e.op)(*_read(env, e.args), **{k: _read(env, v) for k, v in e.kwargs})
        for v, val in zip(e.outputs, e.results(out)):
            if v is not None:
                env[v] = val
        for v in set(e.inputs):
            if last.get(v) == i:
                del env[v]
    return [_read(env, v) for v in g.outputs]


def flatten_inputs(g: Graph, params: Any, batch: Sequence[Any]) -> list[Any]:
    flat, tree = pytree.tree_flatten((params, *batch))
    if g.in_tree is not None and tree != g.in_tree:
        raise IRError(f"inputs do not match the traced structure:\n  traced {g.in_tree}\n  given  {tree}")
    return flat


def evaluate(g: Graph, params: Any, *batch: Any, compiled: bool = True) -> Any:
    """`fn(params, *batch)` recomputed from its graph; returns the same pytree as `fn`."""
    flat = flatten_inputs(g, params, batch)
    if compiled:
        from .compile import compile_graph

        outs = compile_graph(g)(*flat)
    else:
        outs = interpret(g, flat)
    return pytree.tree_unflatten(list(outs), g.out_tree) if g.out_tree is not None else outs


