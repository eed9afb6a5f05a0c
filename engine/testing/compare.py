"""Comparing pytrees of tensors by their worst relative error, for equivalence assertions."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["max_relative_error"]


FLOOR = 1e-6  # leaves below this fraction of the largest are round-off (see max_relative_error)


def max_relative_error(actual: Any, expected: Any) -> float:
    """max over leaves of ‖a − e‖ / max(‖e‖, FLOOR · the largest ‖e‖ of the tree) (‖a − e‖ where all are
    zero); the trees must have one structure. The floor: a leaf whose exact value is zero (a query
    projection's grad when softmax runs over one key) comes back as round-off, 1e-17 where the others are
    1; its error is measured against the tree's scale, not against its own noise."""
    a_leaves, a_tree = pytree.tree_flatten(actual)
    e_leaves, e_tree = pytree.tree_flatten(expected)
    if a_tree != e_tree:
        raise ValueError(f"pytrees differ:\n  actual   {a_tree}\n  expected {e_tree}")
    pairs = []
    for a, e in zip(a_leaves, e_leaves):
        if a.shape != e.shape or a.dtype != e.dtype:
            raise ValueError(f"leaf mismatch: actual {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        pairs.append((a.detach().to(torch.float64), e.detach().to(torch.float64)))
    floor = FLOOR * max((e.norm().item() for _, e in pairs), default=0.0)
    worst = 0.0
    for a64, e64 in pairs:
        diff, norm = (a64 - e64).norm().item(), max(e64.norm().item(), floor)
        worst = max(worst, diff / norm if norm > 0 else diff)
    return worst
