"""Jaxpr-like printing: one equation a line, names given at print time."""
from __future__ import annotations

import hashlib
from typing import Any, Iterable

import torch
import torch.utils._pytree as pytree

from .core import AbstractValue, Eqn, Graph, Literal, Var


def _name(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = letters[r] + s
    return s


class Namer:
    """Gives each variable a short name in order of first appearance."""

    def __init__(self) -> None:
        self.names: dict[Var, str] = {}

    def __call__(self, v: Var) -> str:
        if v not in self.names:
            self.names[v] = _name(len(self.names))
        return self.names[v]

    def decl(self, v: Var) -> str:
        return f"{self(v)}:{v.aval}"


def op_name(op: str) -> str:
    """`aten.add.Tensor` prints as `add.Tensor`, `aten.mm.default` as `mm`."""
    name = op[5:] if op.startswith("aten.") else op
    return name[: -len(".default")] if name.endswith(".default") else name


def format_arg(x: Any, namer: Namer) -> str:
    if isinstance(x, Var):
        return namer(x)
    if isinstance(x, Literal):
        return str(x)
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(format_arg(y, namer) for y in x) + "]"
    if isinstance(x, torch.dtype):
        return str(x).replace("torch.", "")
    if isinstance(x, float):
        return repr(x)
    return str(x)


def format_eqn(e: Eqn, namer: Namer) -> str:
    outs = " ".join(namer.decl(v) if v is not None else "_" for v in e.outputs)
    args = [format_arg(a, namer) for a in e.args]
    args += [f"{k}={format_arg(v, namer)}" for k, v in e.kwargs]
    return f"{outs} = {op_name(e.op)} {' '.join(args)}".rstrip()


def _decls(vs: Iterable[Var], namer: Namer) -> str:
    return " ".join(namer.decl(v) for v in vs)


def format_graph(g: Graph, *, namer: Namer | None = None) -> str:
    namer = namer or Namer()
    head = f"{{ lambda {_decls(g.params, namer)} ; {_decls(g.batch, namer)}. let".replace("lambda  ;", "lambda ;")
    body = [f"    {format_eqn(e, namer)}" for e in g.eqns]
    outs = " ".join(format_arg(v, namer) for v in g.outputs)
    return "\n".join([head, *body, f"  in ({outs}) }}"])


def format_aval(a: AbstractValue) -> str:
    return str(a)


def program_digest(g: Graph) -> str:
    """What a program computes, digested: its printed text and the values of its tensor constants (which
    print as their type alone). Graphs with equal digests compute the same function of their inputs; two
    that print alike can differ in a constant (BatchNorm's running statistics in eval mode, say)."""
    digest = hashlib.sha256(format_graph(g).encode())
    for x in [*pytree.tree_leaves([(e.args, [v for _, v in e.kwargs]) for e in g.eqns]), *g.outputs]:
        if isinstance(x, Literal) and isinstance(x.value, torch.Tensor):  # an output may be a constant too
            t = x.value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{t.dtype}{tuple(x.value.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
