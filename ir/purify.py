"""Passes that make a traced graph pure: in-place ops become out-of-place, RNG is rejected."""
from __future__ import annotations

import functools
from typing import Any

import attrs
import torch

from .core import Eqn, Graph, Var
from .errors import TraceError
from .trace_errors import ImpureError


@functools.lru_cache(maxsize=None)
def resolve(op: str) -> torch._ops.OpOverload:
    """`aten.add.Tensor` -> torch.ops.aten.add.Tensor."""
    ns, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def bound(e: Eqn) -> dict[str, Any]:
    """An equation's arguments by their schema names, defaults filled in."""
    schema = resolve(e.op)._schema.arguments
    named = dict(zip((a.name for a in schema), e.args))
    named.update(e.kwargs)
    return {a.name: named.get(a.name, a.default_value if a.has_default_value() else None) for a in schema}


def _mutated_positions(op: torch._ops.OpOverload) -> list[int]:
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def is_view(op: torch._ops.OpOverload) -> bool:
    rets = op._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


class NeedsFunctionalization(TraceError):
    """An in-place op this pass cannot rewrite alone (a write through a view, an op with no out-of-place
    twin): `ir.trace` then traces the function through PyTorch's functionalization."""


def _functional_variant(op: torch._ops.OpOverload, where: str) -> str:
    name, overload = op._schema.name.split("::")[1], op._overloadname
    base = name[:-1] if name.endswith("_") else None
    if base is not None:
        packet = getattr(torch.ops.aten, base, None)
        if packet is not None and overload in packet.overloads():
            return f"aten.{base}.{overload}"
    raise NeedsFunctionalization(f"in-place op {op} has no out-of-place form that fnpipe knows{where}; "
                     "write it out-of-place (y = f(x) instead of x.f_())")


def _where(e: Eqn) -> str:
    return f" (at {e.source})" if e.source else ""


def _seeded_op(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def _alias_roots(g: Graph) -> dict[Var, Var]:
    """For each variable, the base it views (itself when it is not a view)."""
    root: dict[Var, Var] = {v: v for v in g.inputs}
    for e in g.eqns:
        op = resolve(e.op)
        for v in e.out_vars:
            root[v] = root.get(e.inputs[0], e.inputs[0]) if is_view(op) and e.inputs else v
    return root


def _check_no_alias_use(g: Graph, start: int, mutated: Var, root: dict[Var, Var], e: Eqn) -> None:
    base = root.get(mutated, mutated)
    for later in g.eqns[start + 1:]:
        for v in later.inputs:
            if v is not mutated and root.get(v, v) is base:
                raise NeedsFunctionalization(
                    f"in-place {e.op} writes into a tensor whose other views are used later{_where(e)}; "
                                 "build the value out-of-place (torch.cat, torch.where, index_put)")


def remove_mutation(g: Graph) -> Graph:
    """Rewrite in-place ops on fresh values to out-of-place ones; reject mutation of inputs."""
    root = _alias_roots(g)
    names = dict(zip(g.inputs, g.input_names))
    rename: dict[Var, Var] = {}
    eqns: list[Eqn] = []
    for i, e in enumerate(g.eqns):
        e = e.replace_inputs(rename)
        op = resolve(e.op)
        pos = _mutated_positions(op)
        if not pos:
            eqns.append(e)
            continue
        if _seeded_op(op):  # `new_empty(...).bernoulli_(p)` (DropPath) is RNG first, in-place second
            raise ImpureError("rng", e.op, at=e.source)
        target = e.args[pos[0]] if pos[0] < len(e.args) else None
        if len(pos) != 1 or not isinstance(target, Var):
            raise NeedsFunctionalization(f"op {e.op} mutates {len(pos)} arguments{_where(e)}; write it out-of-place")
        base = root.get(target, target)
        if base in names:
            raise ImpureError("write", e.op, names[base], e.source)
        _check_no_alias_use(g, i, target, root, e)
        eqns.append(attrs.evolve(e, op=_functional_variant(op, _where(e))))
        rename[target] = e.outputs[0]
    outputs = tuple(rename.get(v, v) if isinstance(v, Var) else v for v in g.outputs)
    return attrs.evolve(g, eqns=tuple(eqns), outputs=outputs)


def _eval_dropout(e: Eqn) -> bool:
    """Dropout that is the identity: eval mode, or p = 0 in train mode (`F.dropout(x, p=0.0, training=True)`)."""
    return e.op in ("aten.dropout.default", "aten.feature_dropout.default", "aten.alpha_dropout.default",
                    "aten.feature_alpha_dropout.default") and \
        (_arg(e, 2, "train", True) is False or _arg(e, 1, "p", 0.5) == 0)


def _arg(e: Eqn, pos: int, name: str, default: object) -> object:
    kw = dict(e.kwargs)
    return kw[name] if name in kw else (e.args[pos] if len(e.args) > pos else default)


def _seeded(e: Eqn) -> bool:
    """Whether the op really draws random numbers (attention only does with dropout_p > 0)."""
    if e.op == "aten.scaled_dot_product_attention.default":
        return _arg(e, 4, "dropout_p", 0.0) != 0.0
    return _seeded_op(resolve(e.op))


def reject_rng(g: Graph) -> Graph:
    """Drop eval-mode dropout (identity) and refuse any op that reads the global RNG."""
    rename: dict[Var, Var] = {}
    eqns: list[Eqn] = []
    for e in g.eqns:
        e = e.replace_inputs(rename)
        if _eval_dropout(e):
            rename[e.outputs[0]] = e.inputs[0]
            continue
        if _seeded(e):
            raise ImpureError("rng", e.op, at=e.source)
        eqns.append(e)
    outputs = tuple(rename.get(v, v) if isinstance(v, Var) else v for v in g.outputs)
    return attrs.evolve(g, eqns=tuple(eqns), outputs=outputs)
