"""Conversion of a torch.fx graph (from make_fx) into an ir.Graph."""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .core import AbstractValue, Eqn, Literal, Var
from .errors import TraceError


def _aval(val: Any, where: str) -> AbstractValue:
    if not isinstance(val, torch.Tensor):
        raise TraceError(f"{where} produced a {type(val).__name__}, not a tensor; fnpipe graphs carry tensors only")
    return AbstractValue.of(val)


def _user_frame(stack: str | None) -> str:
    """The last frame of a recorded stack trace, e.g. `model.py:12 in loss_fn: h = x @ w`."""
    if not stack:
        return ""
    lines = [ln.strip() for ln in stack.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            parts = lines[i].split('"')
            path = parts[1] if len(parts) > 1 else lines[i]
            rest = parts[2] if len(parts) > 2 else ""
            lineno = rest.split("line")[-1].split(",")[0].strip() if "line" in rest else "?"
            func = rest.split(" in ")[-1].strip() if " in " in rest else ""
            return f"{path.rsplit('/', 1)[-1]}:{lineno} in {func}: {code}"
    return ""


def _only_checks(op: torch._ops.OpOverload) -> bool:
    """An op that returns nothing and writes nothing only checks its inputs at run time
    (`_linalg_check_errors`, `_assert_tensor_metadata`): it has no value in a pure graph. (Its check
    repeats what the op before it reported as a value, such as `linalg.inv_ex`'s `info`.)"""
    return not op._schema.returns and not any(a.alias_info is not None and a.alias_info.is_write
                                              for a in op._schema.arguments)


def _regroup(outs: tuple[Var | None, ...], nested: tuple[int | None, ...]) -> list[Any]:
    """Flat outputs back in the op's shape, so fx's getitem nodes (one per level) find them."""
    if not nested:
        return list(outs)
    grouped, it = [], iter(outs)
    for n in nested:
        grouped.append(next(it) if n is None else [next(it) for _ in range(n)])
    return grouped


class FxImporter:
    """Walks fx nodes in order, giving each tensor value a Var and each op call an Eqn."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.env: dict[torch.fx.Node, Any] = {}
        self.inputs: list[Var] = []
        self.eqns: list[Eqn] = []
        self.outputs: tuple[Any, ...] = ()
        self.grad_enabled = True
        self.frozen: list[Eqn] = []  # equations run with grad off (ir.grad_mode makes them stop-gradients)

    def run(self) -> FxImporter:
        handlers = {"placeholder": self._placeholder, "get_attr": self._get_attr,
                    "call_function": self._call, "output": self._output}
        for node in self.gm.graph.nodes:
            if node.op not in handlers:
                raise TraceError(f"unsupported fx node {node.op} {node.target}")
            handlers[node.op](node)
        return self

    def _arg(self, a: Any) -> Any:
        return pytree.tree_map(lambda x: self.env[x] if isinstance(x, torch.fx.Node) else x, a)

    def _placeholder(self, node: torch.fx.Node) -> None:
        v = Var(_aval(node.meta["val"], f"input {node.name}"))
        self.inputs.append(v)
        self.env[node] = v

    def _get_attr(self, node: torch.fx.Node) -> None:
        value = getattr(self.gm, node.target)
        # A captured tensor that requires grad is a parameter the caller forgot: as a constant its grad is lost.
        if not isinstance(value, torch.Tensor) or type(value) is not torch.Tensor or value.requires_grad:
            raise TraceError(
                f"the function captures a tensor from outside ({node.target}, "
                f"{getattr(value, 'shape', '?')}); pass it in params or the batch instead")
        self.env[node] = Literal(value.detach().clone())

    def _set_grad_enabled(self, node: torch.fx.Node) -> None:
        self.grad_enabled = bool(node.args[0])

    def _call(self, node: torch.fx.Node) -> None:
        if node.target is operator.getitem:
            self.env[node] = self.env[node.args[0]][node.args[1]]
            return
        if node.target is torch._C._set_grad_enabled:
            self._set_grad_enabled(node)
            return
        if not isinstance(node.target, torch._ops.OpOverload):
            raise TraceError(
                f"unsupported call {node.target} in the traced function ({_user_frame(node.meta.get('stack_trace'))}); "
                "fnpipe needs a pure function of tensors: remove autocast and hooks from the loss")
        if _only_checks(node.target):
            return
        val = node.meta.get("val")
        multi = isinstance(val, (tuple, list))
        nested = tuple(len(x) if isinstance(x, (tuple, list)) else None for x in val) if multi else ()
        nested = nested if any(n is not None for n in nested) else ()
        vals = [x for v in val for x in (v if isinstance(v, (tuple, list)) else [v])] if multi else [val]
        outs = tuple(Var(AbstractValue.of(x)) if isinstance(x, torch.Tensor) else None for x in vals)
        if not multi and outs[0] is None:
            raise TraceError(f"{node.target} returns {type(val).__name__}: only tensor-valued ops are supported")
        eqn = Eqn(str(node.target), self._arg(tuple(node.args)),
                  tuple((k, self._arg(v)) for k, v in node.kwargs.items()), outs, multi,
                  source=_user_frame(node.meta.get("stack_trace")), nested=nested)
        self.eqns.append(eqn)
        if not self.grad_enabled or any(isinstance(x, torch.Tensor) and x.is_inference() for x in vals):
            self.frozen.append(eqn)
        self.env[node] = _regroup(outs, nested) if multi else outs[0]

    def _output(self, node: torch.fx.Node) -> None:
        flat = pytree.tree_leaves(self._arg(node.args[0]))
        for x in flat:
            if not isinstance(x, (Var, Literal)):
                raise TraceError(f"the function returns {x!r}; every output leaf must be a tensor: a loss "
                                 "function returns one scalar tensor, or (loss, aux) with has_aux=True, aux a "
                                 "pytree of tensors")
        self.outputs = tuple(flat)
