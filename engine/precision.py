"""Mixed precision: a loss function whose float params are cast to a compute dtype inside the traced graph.

    fn16 = engine.precision.mixed_precision(loss_fn, torch.bfloat16)
    step = engine.parallelize(fn16, params, x, y)         # or parallelize(loss_fn, ..., compute_dtype=torch.bfloat16)
    loss, grads = step(params, x, y)                      # params and grads float32: the optimizer updates masters

The params stay in their own dtype (float32 masters: what `step.shard`, the optimizer and checkpoints
see); the cast is an ordinary op of the graph, so each stage casts its own params, its matmuls run in
the compute dtype, and the grads flow back through the cast in the params' dtype. Only params are cast:
float batch leaves reach `fn` as given (cast them in `fn`, e.g. `x.to(w.dtype)`, if the model mixes them
with params). A low-precision float loss is returned in float32, so microbatch losses and the loss
cotangent are summed in float32. Grads equal `torch.func.grad(mixed_precision(fn))` on the same params:
that is the function being differentiated (against float32 `fn` they differ by bf16 rounding).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .errors import PlanError

LOW_PRECISION = (torch.float16, torch.bfloat16)


def cast_params(params: Any, dtype: torch.dtype) -> Any:
    """`params` with every floating tensor leaf cast to `dtype` (others unchanged)."""
    def cast(x: Any) -> Any:
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x

    return pytree.tree_map(cast, params)


def mixed_precision(fn: Callable[..., Any], compute_dtype: torch.dtype = torch.bfloat16) -> Callable[..., Any]:
    """`fn(params, *batch)` computed with its float params cast to `compute_dtype` (see the module docstring)."""
    if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
        raise PlanError(f"compute_dtype must be a floating torch.dtype such as torch.bfloat16, got {compute_dtype!r}")

    @functools.wraps(fn)
    def wrapped(params: Any, *batch: Any) -> Any:
        out = fn(cast_params(params, compute_dtype), *batch)
        if isinstance(out, torch.Tensor) and out.dtype in LOW_PRECISION:
            return out.float()
        return out

    wrapped.compute_dtype = compute_dtype  # type: ignore[attr-defined]
    wrapped.__wrapped_fn__ = fn  # type: ignore[attr-defined]
    return wrapped
