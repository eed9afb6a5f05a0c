"""Keeping one benchmark launch inside its time: a budget every rank agrees on, and a watchdog per run.

A GPU lease gives one command ten minutes. The launch runs its rows in priority order; before each, the
ranks agree (an all-reduce of the elapsed time, so all take the same decision) whether `budget` leaves room
for it, and skip it otherwise, recording why. Each row runs under a watchdog: a row that outlives its time
(PyTorch's compiled zero-bubble schedule hung in an NCCL wait, issue #15) is recorded as hung in the JSON
by rank 0, and every rank ends the process, so the command returns with what it measured.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist


class Guard:
    """The launch's clock: `budget` seconds in all, rows of at least `min_row` seconds, each watched."""

    def __init__(self, budget: float, min_row: float, device: torch.device, *, distributed: bool) -> None:
        self.t0, self.budget, self.min_row = time.perf_counter(), budget, min_row
        self.device, self.distributed = device, distributed

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def room(self, need: float | None = None) -> bool:
        """Whether every rank still has `need` (default `min_row`) seconds of the budget left: the slowest
        rank's clock decides, so all ranks agree."""
        t = torch.tensor([self.elapsed()], dtype=torch.float64, device=self.device)
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0]) + (self.min_row if need is None else need) <= self.budget

    def watched(self, seconds: float, on_hang: Callable[[], None], run: Callable[[], Any]) -> Any:
        """`run()`, or, if it is still running after `seconds`, `on_hang()` and the end of this process."""
        def fire() -> None:
            try:
                on_hang()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        try:
            return run()
        finally:
            timer.cancel()
