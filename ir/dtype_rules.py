"""Operand dtypes that tracing does not check: ops whose CPU and CUDA kernels refuse mixed dtypes.

Tracing runs every op on fake tensors through meta kernels, and some of those (torch 2.13: `matmul` and
`linear` through `mm` / `addmm`, `mv`, the layer / batch / group / instance norms, convolutions traced as
`conv1d`, `index_put`, `index_copy`, `index_add`, the losses with class weights) skip the dtype check their
real kernels make. A float32 param times a float64 batch then traced cleanly
and failed on the first step, inside a compiled program, on the one rank that ran that stage
(`mat1 and mat2 must have the same dtype`). `check_dtypes(g)` refuses such a graph while tracing, on every
rank alike, naming the op, its operands and the fix; `ir.trace` then runs the function once more to find
the line that called it (`locate`).

Two rules, from what the eager CPU kernels accept (every pair of float32, float64, bfloat16, float16):
"same": the floating operands share one dtype. "norm": each param (weight, bias, running statistics)
has the input's dtype, or is float32 beside a bfloat16 / float16 input (mixed precision's usual norms).
"""
from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .core import Graph, Var
from .errors import TraceError
from .trace_errors import frame_line

__all__ = ["RULES", "DtypeError", "check_dtypes", "locate"]

_HALF = (torch.bfloat16, torch.float16)

# op -> (rule, positions of the operands it compares; for "norm" the input first)
RULES: dict[str, tuple[str, tuple[int, ...]]] = {
    "aten.matmul.default": ("same", (0, 1)),  # pre-dispatch tracing keeps the composite ops too
    "aten.linear.default": ("same", (0, 1, 2)),
    "aten.conv1d.default": ("same", (0, 1, 2)),
    "aten.conv2d.default": ("same", (0, 1, 2)),
    "aten.conv3d.default": ("same", (0, 1, 2)),
    "aten.conv_transpose1d.default": ("same", (0, 1, 2)),
    "aten.conv_transpose2d.input": ("same", (0, 1, 2)),
    "aten.conv_transpose3d.input": ("same", (0, 1, 2)),
    "aten.binary_cross_entropy.default": ("same", (0, 1, 2)),
    "aten.cross_entropy_loss.default": ("same", (0, 2)),
    "aten.index_add.default": ("same", (0, 3)),
    "aten.layer_norm.default": ("norm", (0, 2, 3)),
    "aten.batch_norm.default": ("norm", (0, 1, 2, 3, 4)),
    "aten.instance_norm.default": ("norm", (0, 1, 2, 3, 4)),
    "aten.group_norm.default": ("norm", (0, 2, 3)),
    "aten.mm.default": ("same", (0, 1)),  # ... and what they dispatch to (the source line's search sees these)
    "aten.convolution.default": ("same", (0, 1, 2)),
    "aten.addmm.default": ("same", (0, 1, 2)),
    "aten.mv.default": ("same", (0, 1)),
    "aten.addmv.default": ("same", (0, 1, 2)),
    "aten.index_put.default": ("same", (0, 2)),
    "aten.index_copy.default": ("same", (0, 3)),
    "aten.nll_loss_forward.default": ("same", (0, 2)),
    "aten.nll_loss2d_forward.default": ("same", (0, 2)),
    "aten.native_layer_norm.default": ("norm", (0, 2, 3)),
    "aten.native_batch_norm.default": ("norm", (0, 1, 2, 3, 4)),
    "aten._native_batch_norm_legit.default": ("norm", (0, 1, 2, 3, 4)),
    "aten._native_batch_norm_legit_functional.default": ("norm", (0, 1, 2, 3, 4)),
    "aten._native_batch_norm_legit.no_stats": ("norm", (0, 1, 2)),
    "aten._native_batch_norm_legit_no_training.default": ("norm", (0, 1, 2, 3, 4)),
    "aten.native_group_norm.default": ("norm", (0, 1, 2)),
}


class DtypeError(TraceError):
    """An op whose operands' dtypes its kernel refuses; `ir.trace` finds the source line (`located`)."""

    def __init__(self, op: str, shown: str, rule: str, at: str = "") -> None:
        self.op, self.shown, self.rule = op, shown, rule
        mixed = " (params may be float32 beside a bfloat16 or float16 input)" if rule == "norm" else ""
        where = f"\n  at {at}" if at else ""
        super().__init__(
            f"{op} mixes dtypes: {shown}; PyTorch's kernel refuses this{mixed}, so the first step would fail on "
            f"the rank that runs it. Give the params and the batch one dtype (e.g. `x.to(w.dtype)` in the loss "
            f"function, or `module.to(dtype)` and a batch of that dtype){where}")

    def located(self, at: str) -> DtypeError:
        return DtypeError(self.op, self.shown, self.rule, at)


def _same(dtypes: list[torch.dtype]) -> bool:
    return len(set(dtypes)) <= 1


def _norm(dtypes: list[torch.dtype]) -> bool:
    x = dtypes[0]
    return all(d == x or (x in _HALF and d == torch.float32) for d in dtypes[1:])


_CHECKS = {"same": _same, "norm": _norm}


def _refused(op: str, args: tuple, dtype_of) -> list[int] | None:
    """The compared positions when `op`'s rule refuses these operands, else None."""
    rule = RULES.get(op)
    if rule is None:
        return None
    kind, positions = rule
    at = [i for i in positions if i < len(args) and (d := dtype_of(args[i])) is not None and d.is_floating_point]
    if not at or (kind == "norm" and at[0] != 0):
        return None
    return None if _CHECKS[kind]([dtype_of(args[i]) for i in at]) else at


def _short(op: str) -> str:
    return op.removeprefix("aten.").split(".")[0]


def check_dtypes(g: Graph) -> None:
    """DtypeError at the first op of `RULES` whose operands' dtypes its real kernels would refuse."""
    made_by: dict[Var, str] = {}
    names = dict(zip(g.inputs, g.input_names))
    var_dtype = lambda x: x.aval.dtype if isinstance(x, Var) else None  # noqa: E731

    def describe(v: Var) -> str:
        dtype = str(v.aval.dtype).replace("torch.", "")
        return f"'{names[v]}' ({dtype})" if v in names else f"a {dtype} value made by {made_by.get(v, 'an op')}"

    for e in g.eqns:
        at = _refused(e.op, e.args, var_dtype)
        if at is not None:
            raise DtypeError(_short(e.op), ", ".join(describe(e.args[i]) for i in at), RULES[e.op][0])
        made_by.update((v, _short(e.op)) for v in e.out_vars)


class _Stop(Exception):
    pass


class _Finder(TorchDispatchMode):
    """Stops at the first op whose operands a rule refuses (ops as dispatched: `mm` for `matmul`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        dtype_of = lambda x: x.dtype if isinstance(x, torch.Tensor) else None  # noqa: E731
        if _refused(str(func), args, dtype_of) is not None:
            raise _Stop(str(func))
        return func(*args, **(kwargs or {}))


def locate(run: Callable[[], Any]) -> str:
    """The source line where `run()` (the traced function on its fake inputs, under their mode) first
    calls an op with operands a rule refuses; "" when not found (the message stands without it)."""
    try:
        with _Finder():
            run()
    except _Stop as stop:
        frames = traceback.extract_tb(stop.__traceback__)
        inner, own = frame_line(frames, libraries=True), frame_line(frames)
        return inner if own in ("", inner) else f"{inner}\n  called from {own}"
    except Exception:  # noqa: BLE001 -- only a hint
        return ""
    return ""
