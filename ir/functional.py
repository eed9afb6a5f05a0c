"""Tracing through PyTorch's own functionalization: writes into fresh tensors and their views become pure ops.

`x[:, 1:] = y`, `masked_fill_`, `index_put_`, `copy_` into a view, in-place ops inside modules, T5's
`_shift_right`: `torch.func.functionalize` turns each into its out-of-place form plus a `*_scatter`
back into the base, and regenerates the base's other views after the write. Tracing uses the
pre-dispatch flavour (`FunctionalTensorMode(pre_dispatch=True, export=True)`, what `torch.export` runs),
so composite ops stay whole: attention stays one `aten.scaled_dot_product_attention` and grad-mode
regions stay visible to the importer.

Functionalization decomposes `reshape` into `view` (or a copy) by the strides it sees on fake tensors,
and those are one kernel's strides: the fake CPU attention returns a layout the math kernel inside a
backward does not. In a pure graph a view is only a value, so `free_layouts` turns each `view` back
into `reshape`, which views where the strides allow and copies where they do not.

The trace runs in PyTorch's export state (`torch.compiler.is_exporting()` and `is_compiling()` true,
as non-strict `torch.export` sets them): libraries take their graph-capture paths there. Hugging Face
masks, for one, test `padding_mask.all()` in Python unless they see a fake tensor or an export, and a
functional wrapper hides the fake tensor.

Functionalization writes `x[i] = y` as `copy(x[i], y)`, an op autograd has no derivative for; in a
pure graph it is `y` broadcast to the view's shape and cast to its dtype, so `free_layouts` writes it
so (an `expand` and a `_to_copy`), and gradients flow to `y` as they do in eager PyTorch.

A write into an input (params or batch) is not hidden: the function would not be pure, so it is
refused as `ImpureError("write")` and `ir.trace` points at the line that wrote.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils import _pytree as pytree

from .core import AbstractValue, Eqn, Graph, Var
from .trace_errors import ImpureError


def _mutated(t: FunctionalTensor) -> bool:
    torch._sync(t)
    return bool(torch._functionalize_has_data_mutation(t.elem) or torch._functionalize_has_metadata_mutation(t.elem))


def _plain(t: Any) -> Any:
    if not isinstance(t, FunctionalTensor):
        return t
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def functionalized(fn: Callable[..., Any], names: Sequence[str]) -> Callable[..., Any]:
    """`fn(*flat_inputs)` with every mutation functionalized; ImpureError if it writes into input i
    (named `names[i]`)."""

    def run(*xs: Any) -> Any:
        outside = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with outside, FunctionalTensorMode(pre_dispatch=True, export=True):
            ins = [FunctionalTensor.to_functional(x) if isinstance(x, torch.Tensor) else x for x in xs]
            out = fn(*ins)
            for name, x in zip(names, ins):
                if isinstance(x, FunctionalTensor) and _mutated(x):
                    raise ImpureError("write", "an in-place op", name)
            return pytree.tree_map_only(FunctionalTensor, _plain, out)

    return run


def free_layouts(g: Graph) -> Graph:
    """`g` with every `aten.view.default` a `aten.reshape.default` (same values, any input strides), and
    every functional `aten.copy.default` an expand and a cast of its source (differentiable)."""
    eqns: list[Eqn] = []
    for e in g.eqns:
        if e.op == "aten.view.default":
            eqns.append(attrs.evolve(e, op="aten.reshape.default"))
        elif e.op == "aten.copy.default":
            eqns.extend(_copy_as_cast(e))
        else:
            eqns.append(e)
    return attrs.evolve(g, eqns=tuple(eqns))


def _copy_as_cast(e: Eqn) -> list[Eqn]:
    out = e.outputs[0]
    assert out is not None
    src = e.args[1]
    aval = src.aval if isinstance(src, Var) else AbstractValue.of(src.value)
    wide = Var(attrs.evolve(aval, shape=out.aval.shape))
    return [Eqn("aten.expand.default", (src, list(out.aval.shape)), (), (wide,), source=e.source),
            Eqn("aten._to_copy.default", (wide,), (("dtype", out.aval.dtype),), (out,), source=e.source)]


@contextlib.contextmanager
def exporting() -> Iterator[None]:
    """PyTorch's export state, as non-strict `torch.export` sets it (`torch._export.utils._compiling_state_context`)."""
    flags = ("_is_compiling_flag", "_is_exporting_flag")
    old = [getattr(torch.compiler, f, False) for f in flags]
    try:
        for f in flags:
            setattr(torch.compiler, f, True)
        yield
    finally:
        for f, v in zip(flags, old):
            setattr(torch.compiler, f, v)
