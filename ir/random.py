"""Pure randomness: counter-based uniform numbers from an explicit integer key, traceable as plain ops."""
from __future__ import annotations

import torch

_M1, _M2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xBF58476D1CE4E5B9 - (1 << 64)
_MASK31 = (1 << 31) - 1


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser in int64 arithmetic (wrapping), kept to 31 bits."""
    z = z * _M1
    z = torch.bitwise_xor(z, torch.bitwise_right_shift(z, 31) & ((1 << 33) - 1))
    z = z * _M2
    z = torch.bitwise_xor(z, torch.bitwise_right_shift(z, 29) & ((1 << 35) - 1))
    return z & _MASK31


def uniform(key: torch.Tensor, shape: tuple[int, ...], *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Numbers in [0, 1) that depend only on `key` (an int64 tensor, one element) and the position."""
    n = 1
    for s in shape:
        n *= s
    counter = torch.arange(n, dtype=torch.int64, device=key.device).reshape(shape)
    bits = _mix(counter + _mix(key.reshape(()).to(torch.int64) + 1) * 2654435761)
    return bits.to(dtype) * (1.0 / (1 << 31))


def dropout(x: torch.Tensor, p: float, key: torch.Tensor) -> torch.Tensor:
    """Inverted dropout with a mask drawn from `key`: pure, so every rank and replay agrees."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = uniform(key, tuple(x.shape), dtype=torch.float32) >= p
    return torch.where(keep, x / (1.0 - p), torch.zeros_like(x))
