"""Train in a loop, printing `rank R step N` after each step, until killed (tests/engine/test_failures.py).

Launched by the test with torch.distributed's env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), not by
mpirun, so that killing one rank leaves the others to notice on their own:

    python tests/mpi/die.py [schedule] [stages] [dp] [timeout_s]
"""
from __future__ import annotations

import sys
import time

import engine
from tests.mpi import models


def main() -> int:
    schedule, stages, dp, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    params, batch = models.init_params(layers=4), models.batch(size=16)
    step = engine.parallelize(models.loss_fn, params, *batch, schedule=schedule, stages=stages, dp=dp,
                              microbatches=4, timeout=timeout)
    params = step.shard(params)
    for n in range(100_000):
        loss, grads = step(params, *batch)
        print(f"rank {step.world.rank} step {n} loss {loss.item():.6f}", flush=True)
        time.sleep(0.01)  # keep the loop from hogging the shared cores while the test reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
