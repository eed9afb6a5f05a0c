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

The joints stitched from those (`ir.stitch`: a stage's joint made of its pieces' traced ones) and whether each runs
on its stage's strides (`stitch.check_runs`, an interpretation on fake tensors) are shared alike (`STITCHED`): the
in-process harness plans each hypothesis example in a Workshop of its own, and stitching and checking again what
an earlier example had made was a fifth of a property test's time. A stitched joint is keyed as the Workshop keys
it (the stage graph's joint key and its pieces' bounds), and that table is bounded by the equations and constants
it holds.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import attrs
import torch
from torch.utils import _pytree as pytree

import ir

__all__ = ["JOINTS", "STITCHED", "SharedJoints", "Stitched", "WorkshopJoints", "tracing_context"]

SIZE = 256  # joints kept (a block's joint is a few hundred equations)
STITCHED_WEIGHT = 200_000  # equations of the stitched joints kept, ~90 MB (a 70 B plan's stage: some thousands)
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
    (`tracing_context`): a joint traced under other attention settings is not found. Bounded by `size` in all
    of `weight` (one a joint: a count), the least recently used out first."""

    def __init__(self, size: int = SIZE, weight: Callable[[Any], int] = lambda _: 1) -> None:
        self.size, self.weight, self._lock, self._held = size, weight, threading.Lock(), 0
        self._joints: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def get(self, key: Any, default: Any = None) -> Any:
        key = (key, tracing_context())
        with self._lock:
            found = self._joints.get(key)
            if found is not None:
                self._joints.move_to_end(key)
            return default if found is None else found

    def __setitem__(self, key: Any, joint: Any) -> None:
        graph = joint.joint if isinstance(joint, Stitched) else joint
        if graph is not None and _constant_bytes(graph) > CONSTANT_BYTES:
            return
        key, weight = (key, tracing_context()), self.weight(joint)
        with self._lock:
            if key in self._joints:
                self._held -= self.weight(self._joints[key])
            self._joints[key] = joint
            self._joints.move_to_end(key)
            self._held += weight
            while self._held > self.size and self._joints:
                self._held -= self.weight(self._joints.popitem(last=False)[1])

    def __len__(self) -> int:
        return len(self._joints)

    def clear(self) -> None:
        with self._lock:
            self._joints.clear()
            self._held = 0


@attrs.frozen
class Stitched:
    """A stage's joint stitched from its pieces' (None: it is not theirs, the stage is traced whole), and whether
    it runs on the stage's strides (`stitch.check_runs`; None: not asked yet, costing needs no run)."""

    joint: ir.Graph | None
    runs: bool | None = None

    @property
    def weight(self) -> int:
        """What it weighs in `STITCHED`: its equations (~450 bytes each), and its constant tensors' bytes
        (which may reach `CONSTANT_BYTES` in a joint of a few equations) at 512 bytes an equation."""
        if self.joint is None:
            return 1
        return 1 + len(self.joint.eqns) + _constant_bytes(self.joint) // 512


def _constant_bytes(g: ir.Graph) -> int:
    """Bytes of the tensor constants `g`'s equations hold."""
    return sum(x.value.numel() * x.value.element_size() for e in g.eqns
               for x in pytree.tree_leaves((e.args, [v for _, v in e.kwargs]))
               if isinstance(x, ir.Literal) and isinstance(x.value, torch.Tensor))


class WorkshopJoints(_ByGet):
    """One Workshop's joints: all it traced (as before sharing), and those of the process (`JOINTS`) it may use;
    its own kept under the tracing context too, so one made under other attention settings is not found."""

    def __init__(self, shared: SharedJoints) -> None:
        self.shared, self.own = shared, {}

    def get(self, key: Any, default: Any = None) -> Any:
        mine = (key, tracing_context())
        found = self.own.get(mine)
        if found is None:
            found = self.shared.get(key)
            if found is not None:
                self.own[mine] = found
        return default if found is None else found

    def __setitem__(self, key: Any, joint: Any) -> None:
        self.keep(key, joint)
        self.shared[key] = joint  # which may decline it (large constants): this Workshop keeps it all the same

    def keep(self, key: Any, joint: Any) -> None:
        """Kept by this Workshop alone (a failure that may not be the key's: see `Workshop._stitch`)."""
        self.own[(key, tracing_context())] = joint


JOINTS = SharedJoints()
STITCHED = SharedJoints(STITCHED_WEIGHT, weight=lambda s: s.weight)
