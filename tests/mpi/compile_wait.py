"""Run under mpirun -n 2: a rank that compiles far longer than the step timeout does not fail the others.

Rank 1 stands in for a cold compile by sleeping 3 x the timeout before the gather that follows the stage
programs' compile; both ranks must get both ranks' values (`COMPILE_WAIT` bounds that wait, not the
step's timeout), and a gather on the step's own group afterwards must still work. Prints
`WAITED rank R <seconds> <values>`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402
from engine.execution.transport import DistTransport  # noqa: E402

TIMEOUT = 2.0


def main() -> None:
    world = engine.init(timeout=TIMEOUT)
    transport = DistTransport(TIMEOUT, device=world.device)
    start = time.monotonic()
    if world.rank == 1:
        time.sleep(3 * TIMEOUT)  # a compile three times as long as any wait of a step may be
    got = transport.gather_after_compile({"rank": world.rank})
    again = transport.all_gather_json(world.rank)
    print(f"WAITED rank {world.rank} {time.monotonic() - start:.1f} {got} {again}", flush=True)
    transport.close()


if __name__ == "__main__":
    main()
