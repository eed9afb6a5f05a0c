"""A training loop for the failure tests (tests/engine/test_failures.py): it prints `rank R step N`
after each step until killed, and can be told to stall one rank, so the others must notice on their own.

Launched with torch.distributed's env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), not by mpirun
(which would kill the survivors itself):

    python tests/mpi/die.py SCHEDULE STAGES DP TIMEOUT_S [STALL]

STALL is `R:N` (rank R stops halfway through step N and prints `rank R stalled in step N`) or `R:verify`
(rank R stops before the ranks compare plan fingerprints; the default process group is then made here
with a 10-minute timeout, so only parallelize(timeout=...) can end the wait).
"""
from __future__ import annotations

import datetime
import os
import sys
import time

import torch.distributed as dist

import engine
from engine.execution import step as step_mod
from tests.mpi import models

STALL_S = 3600.0


def stall(what: str) -> None:
    print(f"rank {os.environ['RANK']} stalled {what}", flush=True)
    time.sleep(STALL_S)


def mid_step_hook(at_step: int):
    """A runtime hook that stops this rank halfway through its program in step `at_step`."""
    seen = {"step": -1}

    def hook(executor, ins) -> None:
        instrs = executor.program.instrs
        if ins is instrs[0]:
            seen["step"] += 1
        if seen["step"] == at_step and ins is instrs[len(instrs) // 2]:
            stall(f"in step {at_step} before {ins.kind}")
    return hook


def main() -> int:
    schedule, stages, dp, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    who, _, when = (sys.argv[5] if len(sys.argv) > 5 else "-1:").partition(":")
    mine = int(who) == int(os.environ["RANK"])
    hook = mid_step_hook(int(when)) if mine and when.isdigit() else None
    if when == "verify":
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        if mine:
            verify = step_mod.Step.verify
            step_mod.Step.verify = lambda self: (stall("before verify"), verify(self))[1]
    params, batch = models.init_params(layers=4), models.batch(size=16)
    step = engine.parallelize(models.loss_fn, params, *batch, schedule=schedule, stages=stages, dp=dp,
                              microbatches=4, timeout=timeout, hook=hook)
    params = step.shard(params)
    for n in range(100_000):
        loss, _ = step(params, *batch)
        print(f"rank {step.world.rank} step {n} loss {loss.item():.6f}", flush=True)
        time.sleep(0.01)  # leave the shared cores some room while the test reads the output
    return 0


if __name__ == "__main__":
    sys.exit(main())
