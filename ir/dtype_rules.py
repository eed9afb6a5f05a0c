"""Operand dtypes that tracing does not check: ops whose CPU and CUDA kernels refuse mixed dtypes.

Tracing runs every op on fake tensors through meta kernels, and some of those (torch 2.13: `matmul` and
`linear` through `mm` / `addmm`, `mv`, the layer / batch / group / instance norms, convolutions traced as
`conv1d`, `index_put`, `index_copy`, `index_add`, the losses with class weights) skip the dtype check their
real kernels make. A float32 param times a float64 batch then traced cleanly
and failed on the first step, inside a compiled program, on the one rank that ran that stage
(`mat1 and mat2 must have the same dtype`). `check_dtypes(g)` refuses such a graph while tracing, on every
rank alike, naming the op, its operands and the fix; `ir.trace` then runs the function once more to find
the line that called it (`locate`).

The rules, from what the eager kernels accept on the CPU and on an H100 (every pair of float32, float64,
bfloat16, float16; 2026-11-26): "same": the floating operands share one dtype. "norm": each param (weight,
bias, running statistics) has the input's dtype, or is float32 beside a bfloat16 / float16 input (batch
norm); "norm_cpu": the same on the CPU, one dtype on CUDA (layer and group norm). "weight": a class weight
matches the input when the targets are class indices. "put": index_put's values match, but for a 0-d value
on the CPU (the masked-fill path casts it). The graph's device (`ir.trace(device=...)`) picks the rule.
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
    "aten.linear.default": ("same", (0, 1)),  # a bias of its own dtype passes where the input is strided (matmul, add_)
    "aten.conv1d.default": ("same", (0, 1, 2)),
    "aten.conv2d.default": ("same", (0, 1, 2)),
    "aten.conv3d.default": ("same", (0, 1, 2)),
    "aten.conv_transpose1d.default": ("same", (0, 1, 2)),
    "aten.conv_transpose2d.input": ("same", (0, 1, 2)),
    "aten.conv_transpose3d.input": ("same", (0, 1, 2)),
    "aten.binary_cross_entropy.default": ("same", (0, 1)),  # its weight multiplies the loss: any float dtype
    "aten.cross_entropy_loss.default": ("weight", (0, 2)),
    "aten.index_add.default": ("same", (0, 3)),
    "aten.layer_norm.default": ("norm_cpu", (0, 2, 3)),
    "aten.batch_norm.default": ("norm", (0, 1, 2, 3, 4)),
    "aten.instance_norm.default": ("norm", (0, 1, 2, 3, 4)),
    "aten.group_norm.default": ("norm_cpu", (0, 2, 3)),
    "aten.mm.default": ("same", (0, 1)),  # ... and what they dispatch to (the source line's search sees these)
    "aten.convolution.default": ("same", (0, 1, 2)),
    "aten.addmm.default": ("same", (0, 1, 2)),
    "aten.mv.default": ("same", (0, 1)),
    "aten.addmv.default": ("same", (0, 1, 2)),
    "aten.index_put.default": ("put", (0, 2)),
    "aten.index_copy.default": ("same", (0, 3)),
    "aten.nll_loss_forward.default": ("weight", (0, 2)),
    "aten.nll_loss2d_forward.default": ("weight", (0, 2)),
    "aten.native_layer_norm.default": ("norm_cpu", (0, 2, 3)),
    "aten.native_batch_norm.default": ("norm", (0, 1, 2, 3, 4)),
    "aten._native_batch_norm_legit.default": ("norm", (0, 1, 2, 3, 4)),
    "aten._native_batch_norm_legit_functional.default": ("norm", (0, 1, 2, 3, 4)),
    "aten._native_batch_norm_legit.no_stats": ("norm", (0, 1, 2)),
    "aten._native_batch_norm_legit_no_training.default": ("norm", (0, 1, 2, 3, 4)),
    "aten.native_group_norm.default": ("norm_cpu", (0, 1, 2)),
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


Info = Callable[[Any], "tuple[torch.dtype, int, str] | None"]  # an operand's dtype, ndim and device type


def _same(x: list, args: tuple, info: Info) -> bool:
    return len({d for d, _, _ in x}) <= 1


def _norm(x: list, args: tuple, info: Info) -> bool:
    """Params of the input's dtype, or float32 beside a bfloat16 / float16 input (batch norm on CPU and CUDA)."""
    d = x[0][0]
    return all(p == d or (d in _HALF and p == torch.float32) for p, _, _ in x[1:])


def _norm_cpu(x: list, args: tuple, info: Info) -> bool:
    """Layer and group norm take float32 params beside a half input on the CPU; CUDA's kernels refuse them."""
    return _norm(x, args, info) if x[0][2] == "cpu" else _same(x, args, info)


def _weight(x: list, args: tuple, info: Info) -> bool:
    """A class weight matches the input where the targets are class indices (probabilities promote)."""
    target = info(args[1]) if len(args) > 1 else None
    return target is None or target[0].is_floating_point or _same(x, args, info)


def _put(x: list, args: tuple, info: Info) -> bool:
    """The values match; on the CPU a 0-d value takes the masked-fill path, which casts it."""
    return (len(x) > 1 and x[1][1] == 0 and x[0][2] == "cpu") or _same(x, args, info)


_CHECKS = {"same": _same, "norm": _norm, "norm_cpu": _norm_cpu, "weight": _weight, "put": _put}


def _refused(op: str, args: tuple, info: Info) -> list[int] | None:
    """The compared positions when `op`'s rule refuses these operands, else None."""
    rule = RULES.get(op)
    if rule is None:
        return None
    kind, positions = rule
    at = [i for i in positions if i < len(args) and (a := info(args[i])) is not None and a[0].is_floating_point]
    if not at or (kind.startswith("norm") and at[0] != 0) or (kind in ("weight", "put") and at[0] != 0):
        return None
    return None if _CHECKS[kind]([info(args[i]) for i in at], args, info) else at


def _var_info(x: Any) -> tuple[torch.dtype, int, str] | None:
    return (x.aval.dtype, len(x.aval.shape), str(x.aval.device).split(":")[0]) if isinstance(x, Var) else None


def _tensor_info(x: Any) -> tuple[torch.dtype, int, str] | None:
    return (x.dtype, x.dim(), x.device.type) if isinstance(x, torch.Tensor) else None


def _short(op: str) -> str:
    return op.removeprefix("aten.").split(".")[0]


def check_dtypes(g: Graph) -> None:
    """DtypeError at the first op of `RULES` whose operands' dtypes its real kernels would refuse."""
    made_by: dict[Var, str] = {}
    names = dict(zip(g.inputs, g.input_names))

    def describe(v: Var) -> str:
        dtype = str(v.aval.dtype).replace("torch.", "")
        return f"'{names[v]}' ({dtype})" if v in names else f"a {dtype} value made by {made_by.get(v, 'an op')}"

    for e in g.eqns:
        at = _refused(e.op, e.args, _var_info)
        if at is not None:
            raise DtypeError(_short(e.op), ", ".join(describe(e.args[i]) for i in at), RULES[e.op][0])
        made_by.update((v, _short(e.op)) for v in e.out_vars)


class _Stop(Exception):
    pass


class _Finder(TorchDispatchMode):
    """Stops at the first op whose operands a rule refuses (ops as dispatched: `mm` for `matmul`)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _refused(str(func), args, _tensor_info) is not None:
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
