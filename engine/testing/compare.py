"""Comparing pytrees of tensors by their worst relative error, for equivalence assertions."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["max_relative_error"]


FLOOR = 1e-6  # leaves below this fraction of the largest are measured against FLOOR x the largest
ULPS = 1e3  # a leaf within this many of its dtype's epsilons of the largest is round-off of a zero


def max_relative_error(actual: Any, expected: Any) -> float:
    """max over leaves of ‖a − e‖ / max(‖e‖, FLOOR · L), L the largest ‖e‖ of the tree (‖a − e‖ where all are
    zero), or ‖a − e‖ / L for a leaf whose ‖e‖ is at most min(FLOOR, ULPS · eps(its dtype)) · L; the trees must
    have one structure. A leaf whose exact value is zero (a query projection's grad when softmax runs over one key)
    comes back as round-off, 1e-17 where the others are 1: its error is measured against the tree's scale,
    not against its own noise, and below the dtype's round-off of that scale against the scale itself (a
    float64 model's zero grads came back as 1.9e-16 and 5.8e-16 from torch.func.grad and 2.1e-16 and 6.9e-16
    away from them from fnpipe: 2.0e-10 against FLOOR · L, 2e-16 against L)."""
    a_leaves, a_tree = pytree.tree_flatten(actual)
    e_leaves, e_tree = pytree.tree_flatten(expected)
    if a_tree != e_tree:
        raise ValueError(f"pytrees differ:\n  actual   {a_tree}\n  expected {e_tree}")
    pairs = []
    for a, e in zip(a_leaves, e_leaves):
        if a.shape != e.shape or a.dtype != e.dtype:
            raise ValueError(f"leaf mismatch: actual {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        eps = torch.finfo(e.dtype).eps if e.dtype.is_floating_point else 0.0
        pairs.append((a.detach().to(torch.float64), e.detach().to(torch.float64), eps))
    largest = max((e.norm().item() for _, e, _ in pairs), default=0.0)
    worst = 0.0
    for a64, e64, eps in pairs:
        own = e64.norm().item()
        norm = largest if own <= min(FLOOR, ULPS * eps) * largest else max(own, FLOOR * largest)
        diff = (a64 - e64).norm().item()
        worst = max(worst, diff / norm if norm > 0 else diff)
    return worst
