"""Comparing pytrees of tensors by their worst relative error, for equivalence assertions."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["max_relative_error"]


def max_relative_error(actual: Any, expected: Any) -> float:
    """max over leaves of ‖a − e‖ / ‖e‖ (‖a − e‖ where e is zero); the trees must have one structure."""
    a_leaves, a_tree = pytree.tree_flatten(actual)
    e_leaves, e_tree = pytree.tree_flatten(expected)
    if a_tree != e_tree:
        raise ValueError(f"pytrees differ:\n  actual   {a_tree}\n  expected {e_tree}")
    worst = 0.0
    for a, e in zip(a_leaves, e_leaves):
        if a.shape != e.shape or a.dtype != e.dtype:
            raise ValueError(f"leaf mismatch: actual {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        a64, e64 = a.detach().to(torch.float64), e.detach().to(torch.float64)
        diff, norm = (a64 - e64).norm().item(), e64.norm().item()
        worst = max(worst, diff / norm if norm > 0 else diff)
    return worst
