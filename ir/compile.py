"""Lowering a graph to a torch.fx GraphModule: generated Python with per-op cost close to eager."""
from __future__ import annotations

import keyword
import operator
import weakref
from typing import Any, Callable

import torch
import torch.fx

from .core import Graph, Literal, Var
from .printer import Namer
from .purify import resolve

_CACHE: "weakref.WeakKeyDictionary[Graph, Callable[..., tuple[Any, ...]]]" = weakref.WeakKeyDictionary()


def to_fx(g: Graph) -> torch.fx.GraphModule:
    """An fx GraphModule computing `g`; constants become module attributes."""
    fg = torch.fx.Graph()
    root = torch.nn.Module()
    namer = Namer()
    env: dict[Var, torch.fx.Node] = {}
    consts = 0

    def arg(x: Any) -> Any:
        nonlocal consts
        if isinstance(x, Var):
            return env[x]
        if isinstance(x, Literal):
            if not isinstance(x.value, torch.Tensor):
                return x.value
            name = f"_const{consts}"
            consts += 1
            root.register_buffer(name, x.value)
            return fg.get_attr(name)
        if isinstance(x, (list, tuple)):
            return type(x)(arg(y) for y in x)
        return x

    for v in g.inputs:
        name = namer(v)  # `as`, `if`, `in` ... are printed names but not Python argument names
        env[v] = fg.placeholder(name + "_" if keyword.iskeyword(name) else name)
    for e in g.eqns:
        node = fg.call_function(resolve(e.op), arg(e.args), {k: arg(v) for k, v in e.kwargs})
        if e.multi:
            for i, v in enumerate(e.outputs):
                if v is not None:
                    env[v] = fg.call_function(operator.getitem, (node, i))
        else:
            env[e.outputs[0]] = node
    fg.output(tuple(arg(v) for v in g.outputs))
    return torch.fx.GraphModule(root, fg)


def compile_graph(g: Graph) -> Callable[..., tuple[Any, ...]]:
    """The compiled callable for `g` (cached per graph): `fn(*flat_inputs) -> tuple of outputs`."""
    fn = _CACHE.get(g)
    if fn is None:
        fn = to_fx(g)
        _CACHE[g] = fn
    return fn
