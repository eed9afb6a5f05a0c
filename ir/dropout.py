"""Keyed dropout: PyTorch's own dropout calls, drawn from explicit per-row keys instead of the global RNG.

    keys = ir.row_keys(seed, batch_size)           # int64 [batch_size]: one key per row of the FULL batch
    def loss_fn(params, x, y, keys):               # the keys are a batch leaf like any other
        with ir.keyed_dropout(keys):
            h = F.dropout(x @ params["w"], p=0.1, training=True)      # unchanged model code
            ...

Under `keyed_dropout(keys)` every `F.dropout` / `nn.Dropout` / `F.dropout1d/2d/3d` / `torch.dropout` call and
`F.scaled_dot_product_attention(..., dropout_p>0)` draws its mask from `ir.random`'s counter-based hash of
(the row's key, the call's index k in the function, the element's position inside its row). The keys
are a batch leaf, so they are cut into microbatches with the rest of the batch: a microbatch holding
rows 8..15 of the full batch holds their keys, whatever the schedule, stage count, microbatch count or
data-parallel degree. Hence the headline property: **one process running `loss_fn` on the full batch
with the same keys computes exactly the pipelined loss and grads** (`engine.testing` checks it like any
other model), and a step is a pure function of (params, batch, keys), replayable bit for bit.

Why per row, not per microbatch or per rank (as Megatron's and torch's RNG trackers do): a key per
microbatch makes the masks depend on how the batch is cut, so a run can never be compared with (or
resumed as) a run of another layout. JAX keys by the program; we key by the data's position instead,
which is what makes the pipeline reproducible by one process.

The contract: dim 0 of a dropped tensor is the batch, or batch-major (a `[batch * seq, hidden]` view):
its length must be a multiple of the key count, else a TraceError names the call. A sequence-first
layout (`[seq, batch, ...]`) would silently mix rows; put the batch first. Inside the context the
function is traced as plain integer ops (no RNG op reaches the graph); the mode works the same eagerly,
which is how the one-process reference runs. Attention with dropout is computed on the math path
(softmax, keyed dropout, matmul) since the fused kernels draw from the global RNG.

Cost: a mask is two splitmix64 rounds of int64 elementwise ops per element (the planner counts them
like any op), and attention with dropout materialises its [batch, heads, L, S] weights where flash
attention would not; dropout-free runs (p = 0, eval mode) pay nothing.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import TraceError
from .random import _mix

__all__ = ["keyed_dropout", "row_keys"]

_GOLD = 0x9E3779B97F4A7C15 - (1 << 64)
_SALT = 0x632BE59BD9B4E019


def row_keys(seed: int | torch.Tensor, batch_size: int, *, device: str | torch.device | None = None) -> torch.Tensor:
    """An int64 tensor of `batch_size` keys, one per row of the full batch, all derived from `seed`
    (use a new seed each step, e.g. the step number). Row r's key does not depend on `batch_size`."""
    seed = torch.as_tensor(seed, dtype=torch.int64, device=device).reshape(())
    rows = torch.arange(batch_size, dtype=torch.int64, device=device)
    return _mix(rows * _GOLD + _mix(seed + _SALT))


def _dropout(mode: keyed_dropout, input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor:
    return mode.drop(input, p, training, feature=False)


def _feature_dropout(mode: keyed_dropout, input: torch.Tensor, p: float = 0.5, training: bool = True,
                     inplace: bool = False) -> torch.Tensor:
    return mode.drop(input, p, training, feature=True)


def _attention(mode: keyed_dropout, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Math attention with the weights dropped by key (fused kernels draw from the global RNG)."""
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale, **({"enable_gqa": True} if enable_gqa else {}))
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        reps = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(reps, dim=-3), value.repeat_interleave(reps, dim=-3)
    scores = query @ key.transpose(-2, -1) * (scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]))
    L, S = query.shape[-2], key.shape[-2]
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = mode.drop(torch.softmax(scores, dim=-1), dropout_p, True, feature=False)
    return weights @ value


def _wrap(n: int) -> int:
    """`n` as the int64 that wrapping arithmetic gives."""
    n &= (1 << 64) - 1
    return n - (1 << 64) if n >= 1 << 63 else n


_HANDLERS: dict[Callable, Callable[..., torch.Tensor]] = {
    F.dropout: _dropout, torch.dropout: _dropout,
    F.dropout1d: _feature_dropout, F.dropout2d: _feature_dropout, F.dropout3d: _feature_dropout,
    torch.feature_dropout: _feature_dropout,
    F.scaled_dot_product_attention: _attention,
}


class keyed_dropout(TorchFunctionMode):
    """Within this context PyTorch's dropout draws its masks from `keys` (see the module docstring)."""

    def __init__(self, keys: torch.Tensor) -> None:
        super().__init__()
        if not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1:
            raise TraceError(f"keyed_dropout takes the int64 keys of ir.row_keys(seed, batch_size) (one per row), "
                             f"got {getattr(keys, 'dtype', type(keys).__name__)} {tuple(getattr(keys, 'shape', ()))}")
        self.keys, self.calls = keys, 0

    def __torch_function__(self, func: Callable, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            return func(*args, **(kwargs or {}))
        return handler(self, *args, **(kwargs or {}))

    def drop(self, x: torch.Tensor, p: float, training: bool, *, feature: bool) -> torch.Tensor:
        """Inverted dropout of `x` with this call's keyed mask (per channel when `feature`)."""
        if not training or p == 0.0:
            return x
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        call, self.calls = self.calls, self.calls + 1
        if p == 1.0:
            return x * 0.0
        shape = tuple(x.shape[:2]) + (1,) * (x.dim() - 2) if feature else tuple(x.shape)
        keep = self._bits(shape, call, x.device) >= int(round(p * (1 << 31)))
        return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))

    def _bits(self, shape: tuple[int, ...], call: int, device: torch.device) -> torch.Tensor:
        """31 random bits per element: hash(key of its row, call, position inside the row)."""
        rows = self.keys.shape[0]
        if not shape or shape[0] % rows:
            raise TraceError(f"keyed dropout call {call} drops a tensor of shape {list(shape)}, whose dim 0 is not "
                             f"the batch ({rows} rows, or a multiple for a [batch * seq, ...] view); put the batch "
                             "dim first (batch_first=True) so each row keeps its own mask under any microbatching")
        per_row = math.prod(shape) // rows
        keys = self.keys.to(device)
        base = _mix(keys + _wrap((call + 1) * _SALT))
        counter = torch.arange(per_row, dtype=torch.int64, device=device)
        return _mix(base.unsqueeze(1) * _GOLD + counter.unsqueeze(0)).reshape(shape)
