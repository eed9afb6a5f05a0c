"""The training recipe the memory model plans for: optimizer, master-weight and grad dtypes, ZeRO-1.

What a rank holds for its params depends on how it trains, not only on the dtype the params were
given. The usual mixed-precision recipe keeps bf16 params for the forward, fp32 master weights and
fp32 Adam moments: 2 + 2 + 4 + 8 = 16 bytes per param (Megatron-LM's accounting), where planning
from the params alone (bf16 Adam state) counts 8. `Recipe` says it explicitly:

    engine.plan(loss_fn, params, x, y, world_size=1024, device="h100",
                recipe=Recipe(optimizer="adamw", master_dtype=torch.float32, shard_optimizer="auto"))

Per param element, on each rank that holds the param:
  params      the params' own dtype (what the forward reads)
  grads       `grad_dtype` (None: the params' dtype; fnpipe's step returns grads in it)
  master      `master_dtype` copy when it differs from the params' dtype (None or equal: no copy)
  optimizer   state tensors x their dtype (the master dtype if set, else the params'):
              none 0, sgd 1 (momentum), adamw 2 (exp_avg, exp_avg_sq)
With ZeRO-1 (`shard_optimizer`) master weights and optimizer state are split over the stage's dp
replicas (each holds 1/dp); params and grads stay whole (ZeRO-1 is not ZeRO-2/3: the step needs the
full params, and grads are reduce-scattered only after the backward). "auto" lets the planner shard
where a layout does not fit otherwise: ZeRO-1's reduce-scatter + all-gather move the same bytes as
the all-reduce they replace, but add a collective, so it is chosen only where it buys a fit.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from ..errors import PlanError

STATE_TENSORS = {"none": 0, "sgd": 1, "adamw": 2}
ZERO_MODES = (False, True, "auto")


def _itemsize(dtype: torch.dtype | None) -> int | None:
    return None if dtype is None else torch.empty((), dtype=dtype).element_size()


@attrs.frozen
class Recipe:
    """How the params are trained (see the module docstring). Frozen; JSON-able through `to_dict`."""

    optimizer: str = "adamw"
    master_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    shard_optimizer: bool | str = False

    def __attrs_post_init__(self) -> None:
        if self.optimizer not in STATE_TENSORS:
            raise PlanError(f"Recipe(optimizer={self.optimizer!r}): pick one of {sorted(STATE_TENSORS)}, e.g. "
                            "Recipe(optimizer='adamw', master_dtype=torch.float32)")
        if self.shard_optimizer not in ZERO_MODES or (self.shard_optimizer == 1 and self.shard_optimizer is not True):
            raise PlanError(f"Recipe(shard_optimizer={self.shard_optimizer!r}): pick True, False or 'auto'")
        for name in ("master_dtype", "grad_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise PlanError(f"Recipe({name}={dtype!r}) must be a floating torch dtype such as torch.float32")

    def terms(self, param_dtype: torch.dtype, *, zero: bool, dp: int) -> dict[str, float]:
        """Bytes per param element of each term: params, grads, master, optimizer (ZeRO: the last two / dp)."""
        size = _itemsize(param_dtype) or 4
        copy = _itemsize(self.master_dtype) if self.master_dtype not in (None, param_dtype) else 0
        state = (_itemsize(self.master_dtype) or size) * STATE_TENSORS[self.optimizer]
        share = dp if self.sharded(zero, dp) else 1
        return {"params": float(size), "grads": float(_itemsize(self.grad_dtype) or size),
                "master": (copy or 0) / share, "optimizer": state / share}

    def sharded(self, zero: bool, dp: int) -> bool:
        return bool(zero) and dp > 1

    def to_dict(self) -> dict[str, Any]:
        dtype = lambda d: None if d is None else str(d).removeprefix("torch.")  # noqa: E731
        return {"optimizer": self.optimizer, "master_dtype": dtype(self.master_dtype),
                "grad_dtype": dtype(self.grad_dtype), "shard_optimizer": self.shard_optimizer}


def recipe_of(value: Recipe | None) -> Recipe | None:
    if value is None or isinstance(value, Recipe):
        return value
    raise PlanError(f"recipe must be an engine.Recipe (e.g. Recipe(optimizer='adamw', master_dtype=torch.float32)), "
                    f"got {type(value).__name__}")
