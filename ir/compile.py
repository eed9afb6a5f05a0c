"""Lowering a graph to a torch.fx GraphModule: generated Python with per-op cost close to eager."""
from __future__ import annotations

import itertools
import keyword
import linecache
import operator
import re
import types
import weakref
from typing import Any, Callable

import torch
import torch.fx

from .core import Graph, Literal, Var
from .device import require_runnable
from .printer import Namer
from .purify import resolve

_CACHE: "weakref.WeakKeyDictionary[Graph, dict[tuple[int, ...], Callable[..., tuple[Any, ...]]]]" = \
    weakref.WeakKeyDictionary()


class _Builder:
    """Builds the fx graph of an IR graph: values by variable, constants as module buffers, and the
    in-place adds into accumulators right where the accumulated values are made."""

    def __init__(self) -> None:
        self.fg, self.root = torch.fx.Graph(), torch.nn.Module()
        self.env: dict[Var, torch.fx.Node] = {}
        self.into: dict[Any, list[torch.fx.Node]] = {}  # value -> accumulators it is added into
        self.consts = 0

    def arg(self, x: Any) -> Any:
        if isinstance(x, Var):
            return self.env[x]
        if isinstance(x, Literal):
            if not isinstance(x.value, torch.Tensor):
                return x.value
            name = f"_const{self.consts}"
            self.consts += 1
            self.root.register_buffer(name, x.value)
            return self.fg.get_attr(name)
        if isinstance(x, (list, tuple)):
            return type(x)(self.arg(y) for y in x)
        return x

    def define(self, v: Var, node: torch.fx.Node) -> None:
        self.env[v] = node
        for acc in self.into.pop(v, ()):
            self.fg.call_function(torch.ops.aten.add_.Tensor, (acc, node))

    def eqn(self, e: Any) -> None:
        node = self.fg.call_function(resolve(e.op), self.arg(e.args), {k: self.arg(v) for k, v in e.kwargs})
        if not e.multi:
            self.define(e.outputs[0], node)
            return
        for pos, v in zip(e.positions(), e.outputs):
            if v is not None:
                x = node
                for k in pos:
                    x = self.fg.call_function(operator.getitem, (x, k))
                self.define(v, x)


def to_fx(g: Graph, accumulate: tuple[int, ...] = ()) -> torch.fx.GraphModule:
    """An fx GraphModule computing `g`; constants become module attributes.

    `accumulate` lists output positions that are added in place into accumulators instead of being
    returned: the module takes one extra trailing argument per position (in that order) and returns
    None there. Each add follows the equation that makes the value, so the value dies at once (eager
    autograd's AccumulateGrad): a backward never holds a second copy of all its weight grads.
    """
    b, namer = _Builder(), Namer()
    for v in g.inputs:
        name = namer(v)  # `as`, `if`, `in` ... are printed names but not Python argument names
        b.env[v] = b.fg.placeholder(name + "_" if keyword.iskeyword(name) else name)
    for j, k in enumerate(accumulate):
        b.into.setdefault(g.outputs[k], []).append(b.fg.placeholder(f"_acc{j}"))
    for v in [v for v in b.into if isinstance(v, Var) and v in b.env]:  # an input returned as is
        b.define(v, b.env[v])
    for e in g.eqns:
        b.eqn(e)
    for v, accs in b.into.items():  # literal outputs
        for acc in accs:
            b.fg.call_function(torch.ops.aten.add_.Tensor, (acc, b.arg(v)))
    skip = set(accumulate)
    b.fg.output(tuple(None if k in skip else b.arg(v) for k, v in enumerate(g.outputs)))
    return torch.fx.GraphModule(b.root, b.fg)


_OP_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")  # fx's text for a call of an op overload
_PROGRAMS = itertools.count()


def bound_ops(gm: torch.fx.GraphModule) -> Callable[..., Any]:
    """`gm`'s forward, its code as fx generated it (values freed after their last use) but for each op overload's
    call: `torch.ops.aten.mm.default(a, b)` looks up four attributes and runs the overload's Python `__call__`,
    which calls its C++ builtin (`OpOverload._op`); here the code calls that builtin by a name of its own, as
    eager PyTorch's Python calls its builtins. About 0.7 of the 2.4 us a call costs on a 2-core CPU host, times
    every op of a launch-bound program (an fx Llama stage's forward runs at its host's pace on an H200). Not for
    torch.compile, which traces op overloads, not their builtins (`to_fx` for that)."""
    names: dict[str, Any] = {}

    def bind(m: re.Match[str]) -> str:
        overload = getattr(getattr(getattr(torch.ops, m[1]), m[2]), m[3])
        name = f"_op_{m[1]}_{m[2]}_{m[3]}"
        names[name] = getattr(overload, "_op", overload)
        return f"{name}("

    code = _OP_CALL.sub(bind, gm.code)
    filename = f"<fnpipe program {next(_PROGRAMS)}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # tracebacks show the line
    weakref.finalize(gm, linecache.cache.pop, filename, None)  # kept while the program lives, no longer
    scope = {**gm.forward.__func__.__globals__, **names}  # type: ignore[attr-defined]
    exec(compile(code, filename, "exec"), scope)  # noqa: S102 -- code fx generated, its calls renamed
    return types.MethodType(scope["forward"], gm)


def compile_graph(g: Graph, accumulate: tuple[int, ...] = ()) -> Callable[..., tuple[Any, ...]]:
    """The compiled callable for `g` (cached per graph and `accumulate`): `fn(*flat_inputs) -> tuple of
    outputs`; with `accumulate` (see `to_fx`), `fn(*flat_inputs, *accumulators)`. fx's generated program, its op
    calls bound (`bound_ops`). IRError for a graph traced for a device this machine lacks."""
    per_graph = _CACHE.setdefault(g, {})
    fn = per_graph.get(accumulate)
    if fn is None:
        require_runnable(g)
        fn = per_graph[accumulate] = bound_ops(to_fx(g, accumulate))
    return fn
