"""The traced joints of this process, shared by every Workshop: a model planned again traces no joint again.

Tracing a joint (make_fx of a block's forward and backward) is planning's dearest pass after the order search.
A Workshop lives for one `parallelize`; a second one of the same model (another schedule, stage count or data-
parallel degree, `schedule="auto"`'s candidates planned apart, a sweep, a test suite) had its joints traced
afresh. A joint depends only on what `ir.autodiff.joint_key` holds (the graph's text and the values of its
tensor constants, what is differentiated, the device) and on the attention kernels allowed, so one process-wide
table can serve them all: bounded
(least recently used out), locked (the in-process runtime plans on threads), keyed also by the settings a trace
reads (`tracing_context`: the attention kernels allowed), and holding no joint whose graph carries large constant
tensors (a model's tables captured as constants stay with their Workshop alone: `WorkshopJoints`).
"""
from __future__ import annotations

import collections
import threading
from typing import Any

import torch
from torch.utils import _pytree as pytree

import ir

__all__ = ["JOINTS", "SharedJoints", "WorkshopJoints", "tracing_context"]

SIZE = 256  # joints kept (a block's joint is a few hundred equations)
CONSTANT_BYTES = 1 << 20  # a graph whose tensor constants hold more is not kept


def tracing_context() -> tuple[Any, ...]:
    """The process-wide settings a joint's trace reads besides its key: which attention kernels may run (a
    traced `scaled_dot_product_attention` becomes the kernel they allow, `torch.nn.attention.sdpa_kernel`)."""
    cuda = torch.backends.cuda
    flags = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")
    return tuple(getattr(cuda, flag)() if hasattr(cuda, flag) else None for flag in flags)


class _ByGet:
    """`in` and `[]` of a joints table, through the `get` of the class that takes it on."""

    def __contains__(self, key: Any) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key: Any) -> ir.Graph:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found


class SharedJoints(_ByGet):
    """A bounded, locked mapping joint key -> traced joint, each kept under the tracing context it was traced in
    (`tracing_context`): a joint traced under other attention settings is not found."""

    def __init__(self, size: int = SIZE) -> None:
        self.size, self._lock = size, threading.Lock()
        self._joints: collections.OrderedDict[Any, ir.Graph] = collections.OrderedDict()

    def get(self, key: Any, default: ir.Graph | None = None) -> ir.Graph | None:
        key = (key, tracing_context())
        with self._lock:
            found = self._joints.get(key)
            if found is not None:
                self._joints.move_to_end(key)
            return default if found is None else found

    def __setitem__(self, key: Any, joint: ir.Graph) -> None:
        if _constant_bytes(joint) > CONSTANT_BYTES:
            return
        key = (key, tracing_context())
        with self._lock:
            self._joints[key] = joint
            self._joints.move_to_end(key)
            while len(self._joints) > self.size:
                self._joints.popitem(last=False)

    def __len__(self) -> int:
        return len(self._joints)

    def clear(self) -> None:
        with self._lock:
            self._joints.clear()


def _constant_bytes(g: ir.Graph) -> int:
    """Bytes of the tensor constants `g`'s equations hold."""
    return sum(x.value.numel() * x.value.element_size() for e in g.eqns
               for x in pytree.tree_leaves((e.args, [v for _, v in e.kwargs]))
               if isinstance(x, ir.Literal) and isinstance(x.value, torch.Tensor))


class WorkshopJoints(_ByGet):
    """One Workshop's joints: all it traced (as before sharing), and those of the process (`JOINTS`) it may use."""

    def __init__(self, shared: SharedJoints) -> None:
        self.shared, self.own = shared, {}

    def get(self, key: Any, default: ir.Graph | None = None) -> ir.Graph | None:
        found = self.own.get(key)
        if found is None:
            found = self.shared.get(key)
            if found is not None:
                self.own[key] = found
        return default if found is None else found

    def __setitem__(self, key: Any, joint: ir.Graph) -> None:
        self.own[key] = joint
        self.shared[key] = joint  # which may decline it (large constants): this Workshop keeps it all the same


JOINTS = SharedJoints()
