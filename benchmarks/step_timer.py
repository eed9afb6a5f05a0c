"""Timing a training step: warm-up, per-step wall time (slowest rank), losses, and peak memory per rank."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import attrs
import torch
import torch.distributed as dist


@attrs.frozen
class Measurement:
    """Seconds of each measured step (the slowest rank's), every step's loss, peak bytes per rank and bytes
    allocated before the first step (weights and whatever else was live; None on CPU), both less the bytes
    earlier rows of the launch left allocated (`residue_bytes`: not this row's)."""

    times: tuple[float, ...]
    losses: tuple[float, ...]
    peak_bytes: tuple[int, ...] | None
    start_bytes: tuple[int, ...] | None = None
    first_s: float | None = None  # the first (warm-up) step: compiles, allocator growth
    residue_bytes: tuple[int, ...] | None = None


    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def to_json(self) -> dict[str, Any]:
        return {"median_s": self.median, "times_s": list(self.times), "losses": list(self.losses),
                "peak_bytes": list(self.peak_bytes) if self.peak_bytes is not None else None,
                "start_bytes": list(self.start_bytes) if self.start_bytes is not None else None,
                "first_step_s": self.first_s,
                "residue_bytes": list(self.residue_bytes) if self.residue_bytes is not None else None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(value: torch.Tensor, device: torch.device, op: str) -> torch.Tensor:
    """`value` (1-d float64) combined over ranks: max, or gathered to [world, n]."""
    t = value.to(device)
    if op == "max":
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.cpu()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def measure(step_fn: Callable[[], Any], *, loss_of: Callable[[Any], float], warmup: int, steps: int,
            device: torch.device, across_ranks: bool = True, label: str = "", residue: int = 0) -> Measurement:
    """Run `step_fn` warmup + steps times; each step is timed from a common start (barrier) to this rank's
    device being idle. `loss_of(output)` runs outside the timed region (it may be a collective). `residue`:
    bytes this rank held before the row was built (what earlier rows left), taken off its peak."""
    distributed = across_ranks and dist.is_initialized() and dist.get_world_size() > 1
    start = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    times, losses, first = [], [], None
    for k in range(warmup + steps):
        if distributed:
            dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        out = step_fn()
        _sync(device)
        dt = time.perf_counter() - t0
        losses.append(loss_of(out))
        del out
        if k >= warmup:
            times.append(dt)
        if k == 0:
            first = dt
        if label and (k == 0 or k == warmup - 1 or k == warmup + steps - 1):
            print(f"  {label}: step {k + 1}/{warmup + steps} {dt:.3f} s, loss {losses[-1]:.4f}", flush=True)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if distributed:
        times = _spread(torch.tensor(times, dtype=torch.float64), device, "max").tolist()
    if peak is None:
        return Measurement(tuple(times), tuple(losses), None, first_s=first)
    mem = torch.tensor([float(peak - residue), float(start - residue), float(residue)], dtype=torch.float64)
    rows = _spread(mem, device, "gather") if distributed else mem[None]
    return Measurement(tuple(times), tuple(losses), tuple(int(x) for x in rows[:, 0]), tuple(int(x) for x in rows[:, 1]),
                       first_s=first, residue_bytes=tuple(int(x) for x in rows[:, 2]))


def paired(a: Callable[[], Any], b: Callable[[], Any], *, rounds: int, device: torch.device,
           warmup: int = 2) -> tuple[list[float], list[float]]:
    """Seconds of `a` and `b` (each one step, one process) alternated: `warmup` untimed rounds, then `rounds`
    rounds of one timed `a` step and one timed `b` step, `a` first in even rounds and `b` first in odd ones (what
    runs second in a round meets what the first left behind). A shared machine's host moves between paces (11
    against 18 ms for the same Python on an H200 host, `host_pace.py`, session 30), and two rows timed minutes apart
    may each meet another pace; a round's two steps meet the same one, so the median of the rounds' ratios compares
    the two at one pace."""
    def timed(step: Callable[[], Any]) -> float:
        _sync(device)
        t0 = time.perf_counter()
        out = step()
        _sync(device)
        del out
        return time.perf_counter() - t0

    for _ in range(warmup):
        timed(a), timed(b)
    times: tuple[list[float], list[float]] = ([], [])
    for k in range(rounds):
        first, second = (0, 1) if k % 2 == 0 else (1, 0)
        for which in (first, second):
            times[which].append(timed((a, b)[which]))
    return times
