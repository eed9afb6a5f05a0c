"""Deliberate runtime faults, injected through the executor's test hook, that the harness must catch.

Each fault is a hook `(executor, instr)` for `assert_parallel_equivalent(..., hook=fault)` (or
`engine.parallelize(..., hook=...)`). It acts on one world rank only and counts in `fired` how often it
acted, so a test can tell "the harness missed it" from "the fault never applied":

    fault = DropWeightGrad(rank=0)
    with pytest.raises(ParallelMismatch):
        assert_parallel_equivalent(fn, params, x, y, schedule="zb-h1", stages=2, microbatches=4, hook=fault)
    assert fault.fired

A fault that must undo what it did (a swapped batch) does it at the hook's next call, which is before
the next instruction: every program ends with `reduce_loss`, so there always is one. A hook that returns
"skip" (`SKIP`) makes the runtime skip the instruction.
"""
from __future__ import annotations

import abc
from typing import Any, Callable

import torch

from ..execution.program import Instr

__all__ = ["SKIP", "DropWeightGrad", "Fault", "ScaleGrad", "StaleActivation", "SwapMicrobatches"]

SKIP = "skip"  # what a hook returns to make the runtime skip the instruction


class Fault(abc.ABC):
    """Base: `apply` runs only on world rank `rank`; `pending` undoes the previous instruction's change."""

    options: tuple[str, ...] = ()  # the constructor's settings, for repr

    def __init__(self, rank: int) -> None:
        self.rank, self.fired = rank, 0
        self.pending: Callable[[], None] | None = None

    def __call__(self, executor: Any, ins: Instr) -> str | None:
        if executor.transport.rank != self.rank:
            return None
        if self.pending is not None:
            self.pending, undo = None, self.pending
            undo()
        if ins is executor.program.instrs[0]:
            self.reset()
        return self.apply(executor, ins)

    def reset(self) -> None:
        """A step starts on the rank (one fault can serve several checks)."""

    @abc.abstractmethod
    def apply(self, executor: Any, ins: Instr) -> str | None:
        """Act before `ins` on this rank; return SKIP to have the runtime skip it."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in ("rank", *self.options, "fired"))
        return f"{type(self).__name__}({fields})"


def _first(executor: Any, match: Callable[[Instr], bool]) -> Instr | None:
    return next((i for i in executor.program.instrs if match(i)), None)


class SwapMicrobatches(Fault):
    """The forward of microbatch `first` reads microbatch `second`'s batch data (B and W still read `first`'s)."""

    options = ("first", "second")

    def __init__(self, rank: int = 0, first: int = 0, second: int = 1) -> None:
        super().__init__(rank)
        self.first, self.second = first, second

    def apply(self, executor: Any, ins: Instr) -> str | None:
        if ins.kind != "forward" or ins.mb != self.first or not any(r.startswith("x") for r in ins.reads):
            return None
        if self.second >= len(executor.mbs):
            return None
        mbs = executor.mbs
        swapped = list(mbs)
        swapped[self.first], swapped[self.second] = mbs[self.second], mbs[self.first]
        executor.mbs = swapped
        self.pending = lambda: setattr(executor, "mbs", mbs)
        self.fired += 1
        return None


class DropWeightGrad(Fault):
    """The weight grads of one backward (of `stage`, default the rank's first W or BW of microbatch `mb`)
    never reach the accumulators: a W is skipped (the hook returns "skip"); a fused BW runs, since its
    input grads are still sent on, but adds its weight grads into scratch tensors that are dropped."""

    options = ("mb", "stage")

    def __init__(self, rank: int = 0, mb: int = 0, stage: int | None = None) -> None:
        super().__init__(rank)
        self.mb, self.stage = mb, stage

    def apply(self, executor: Any, ins: Instr) -> str | None:
        target = _first(executor, lambda i: i.kind in ("backward_weight", "backward") and i.mb == self.mb
                        and (self.stage is None or i.stage == self.stage) and any(w.startswith("g") for w in i.writes))
        if ins != target:
            return None
        self.fired += 1
        if ins.kind == "backward_weight":
            return SKIP
        executor.accumulator = lambda leaf: torch.zeros_like(executor.params[leaf])  # thrown away
        self.pending = lambda: delattr(executor, "accumulator")  # the class's accumulator again
        return None


class ScaleGrad(Fault):
    """Before the rank's grads are reduced, multiply one accumulator (`leaf`, default the rank's largest)."""

    options = ("factor", "leaf")

    def __init__(self, rank: int = 0, factor: float = 2.0, leaf: int | None = None) -> None:
        super().__init__(rank)
        self.factor, self.leaf = factor, leaf

    def apply(self, executor: Any, ins: Instr) -> str | None:
        if ins != _first(executor, lambda i: i.kind in ("reduce_grads", "reduce_loss")) or not executor.grads:
            return None
        pid = self.leaf if self.leaf is not None else max(executor.grads, key=lambda p: executor.grads[p].norm().item())
        executor.grads[pid] = executor.grads[pid] * self.factor
        self.fired += 1
        return None


class StaleActivation(Fault):
    """The forward of microbatch `mb` reuses the activations the rank received for the previous one."""

    options = ("mb",)

    def __init__(self, rank: int = 1, mb: int = 1) -> None:
        super().__init__(rank)
        self.mb = mb
        self.reset()

    def reset(self) -> None:
        self.received: dict[tuple[int, int], tuple[str, ...]] = {}
        self.last: dict[int, list[torch.Tensor]] = {}

    def apply(self, executor: Any, ins: Instr) -> str | None:
        if ins.kind == "comm":
            self.received.update(((c.stage, c.mb), c.bufs) for c in ins.comm if c.op == "recv" and c.what == "act")
            return None
        refs = self.received.get((ins.stage, ins.mb)) if ins.kind == "forward" else None
        if not refs:
            return None
        current = [executor.read(r, ins.mb) for r in refs]  # waits for the receive, as the forward would
        if ins.mb == self.mb and ins.stage in self.last:
            for ref, stale in zip(refs, self.last[ins.stage]):
                executor.bufs[ref] = stale.clone()
            self.fired += 1
        self.last[ins.stage] = [t.clone() for t in current]
        return None
