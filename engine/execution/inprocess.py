"""Running every rank's program inside one process: threads for ranks, a Hub for P2P and sums.

This is what `engine.testing` checks models with: the same programs and runtime as a real job, with
rendezvous semantics, so a deadlocking program is reported instead of hanging.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

from ..planning.artifacts import Planned, Workshop, planned_from
from ..planning.plan import Plan
from .assemble import assemble
from .executor import Hook
from .launch import World
from .step import Step
from .transport import Hub, LocalTransport


@attrs.frozen
class InProcessResult:
    """Loss and full grad tree assembled from all ranks, plus each rank's own (loss, grads)."""

    loss: torch.Tensor
    grads: Any
    per_rank: tuple[tuple[torch.Tensor, Any], ...]
    steps: tuple[Step, ...]


def build_steps(fn: Callable, params: Any, batch: Sequence[Any], plan: Plan | Planned, *, timeout: float = 30.0,
                hook: Hook | None = None, has_aux: bool = False) -> tuple[Step, ...]:
    """Every rank's Step of `plan` on CPU over one hub; a Plan gets its artefacts traced here, once."""
    workshop = Workshop(fn, params, batch, device="cpu", has_aux=has_aux)
    planned = plan if isinstance(plan, Planned) else planned_from(plan, workshop)
    return steps_of(planned, timeout=timeout, hook=hook)


def steps_of(planned: Planned, *, timeout: float = 30.0, hook: Hook | None = None) -> tuple[Step, ...]:
    """One Step per world rank of `planned`, each with the program `assemble` makes for it."""
    hub = Hub(planned.plan.world_size, timeout)
    cpu = torch.device("cpu")
    return tuple(Step(planned, World(r, planned.plan.world_size, r, cpu, False), LocalTransport(hub, r), hook=hook,
                      program=assemble(planned, r)) for r in range(planned.plan.world_size))


def run_steps(steps: Sequence[Step], params: Any, batch: Sequence[Any]) -> InProcessResult:
    """One step on every rank at once; raises the first rank's error (deadlock, timeout, mismatch)."""
    return _assemble(steps, run_each(steps, lambda step: step(step.shard(params), *batch)))


def run_each(steps: Sequence[Step], work_of: Callable[[Step], Any]) -> list[Any]:
    """`work_of(step)` on every rank at once (a thread each), each rank's result in rank order; raises the
    first rank's error (deadlock, timeout, mismatch)."""
    results: list[Any] = [None] * len(steps)
    errors: list[BaseException | None] = [None] * len(steps)
    hub = steps[0].transport.hub  # type: ignore[attr-defined]
    with hub.cv:
        hub.alive, hub.failure = set(range(len(steps))), None

    def work(r: int) -> None:
        try:
            results[r] = work_of(steps[r])
            hub.exit(r)
        except BaseException as exc:  # noqa: BLE001 -- reported to the caller below
            errors[r] = exc
            hub.exit(r, f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and "failed:" not in str(e)), None) or next(
        (e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def _assemble(steps: Sequence[Step], results: list[Any]) -> InProcessResult:
    n = steps[0].graph.num_params
    merged: list[Any] = [None] * n
    for step, (_, grads) in zip(steps, results):
        leaves = pytree.tree_leaves(grads, is_leaf=lambda x: x is None)
        for pid in range(n):
            if merged[pid] is None and leaves[pid] is not None:
                merged[pid] = leaves[pid]
    tree = pytree.tree_structure(results[0][1], is_leaf=lambda x: x is None)
    return InProcessResult(results[0][0], pytree.tree_unflatten(merged, tree), tuple(results), tuple(steps))
