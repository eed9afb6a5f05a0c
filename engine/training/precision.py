"""Mixed precision: a loss function whose float params are cast to a compute dtype inside the traced graph.

    fn16 = engine.precision.mixed_precision(loss_fn, torch.bfloat16)
    step = engine.parallelize(fn16, params, x, y)         # or parallelize(loss_fn, ..., compute_dtype=torch.bfloat16)
    loss, grads = step(params, x, y)                      # params and grads float32: the optimizer updates masters

The params stay in their own dtype (float32 masters: what `step.shard`, the optimizer and checkpoints
see). Every torch call inside `fn` that reads a float param gets `param.to(compute_dtype)` instead, so
the cast is an ordinary op of the graph placed right before each use: a stage casts the params it uses
(a tied weight once per use, never carried between stages as an activation), its matmuls run in the
compute dtype, and the grads flow back through the casts in the params' own dtype. Reading `param.dtype`
inside `fn` gives the compute dtype, as if the params had been cast. Only params are cast, never the
batch as such: float batch leaves reach `fn` in their own dtype, and an activation or batch value meets
the compute dtype only at a call that also reads a param (`F.linear(x, w)` casts `x` too, as PyTorch
would refuse float32 x bfloat16); ops without params run in whatever dtype their inputs have, so a
float32 target stays float32 in the loss. A low-precision float loss is returned in float32, so
microbatch losses and the loss cotangent are summed in float32. Grads equal
`torch.func.grad(mixed_precision(fn))` on the same params: that is the function being differentiated
(against float32 `fn` they differ by bf16 rounding).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import PlanError

LOW_PRECISION = (torch.float16, torch.bfloat16)
VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})  # properties that compute with the tensor


class CastParams(TorchFunctionMode):
    """While active, a torch call that reads one of the float tensors `params` computes in `dtype`: its
    float tensor arguments are cast (metadata reads such as `.shape` see the param itself, `.dtype`
    the compute dtype)."""

    def __init__(self, params: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.ids = {id(x) for x in pytree.tree_leaves(params) if isinstance(x, torch.Tensor) and x.is_floating_point()}
        self.dtype = dtype

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.is_floating_point() and x.dtype != self.dtype else x

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__":  # a Tensor property
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop == "dtype" and args and id(args[0]) in self.ids:
                return self.dtype
            if prop not in VIEW_PROPERTIES:
                return func(*args, **kwargs)
        if any(id(x) in self.ids for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)):
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._cast, (args, kwargs))
        return func(*args, **kwargs)


def mixed_precision(fn: Callable[..., Any], compute_dtype: torch.dtype = torch.bfloat16) -> Callable[..., Any]:
    """`fn(params, *batch)` computed with its float params cast to `compute_dtype` (see the module docstring)."""
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise PlanError(f"compute_dtype must be a floating torch.dtype such as torch.bfloat16, got {compute_dtype!r}")

    @functools.wraps(fn)
    def wrapped(params: Any, *batch: Any) -> Any:
        with CastParams(params, compute_dtype):
            out = fn(params, *batch)
        if isinstance(out, torch.Tensor) and out.dtype in LOW_PRECISION:
            return out.float()
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor) \
                and out[0].dtype in LOW_PRECISION:  # (loss, aux) of has_aux
            return out[0].float(), out[1]
        return out

    wrapped.compute_dtype = compute_dtype  # type: ignore[attr-defined]
    return wrapped
