"""Run under mpirun -n 2: rank 0 calibrating far longer than the step timeout does not fail the others.

Rank 0's op timing (`_calibrate_here`) is made to take 3 x the timeout first, as a wide ResNet's hundreds
of convolution shapes do on a GPU (2026-11-26: rank 1 of resnet101x4 died at the 60 s broadcast). Both
ranks must then plan from rank 0's table and train. Prints `CALIBRATED rank R <seconds waited> <loss>`.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402
import engine.parallelize  # noqa: E402

parallelize_mod = sys.modules["engine.parallelize"]

TIMEOUT = 2.0


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w0"])
    return (torch.tanh(h @ params["w1"]) ** 2).mean()


def main() -> None:
    world = engine.init(timeout=TIMEOUT)
    real = parallelize_mod._calibrate_here

    def slow(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(3 * TIMEOUT)
        return real(*args, **kwargs)

    parallelize_mod._calibrate_here = slow
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(16, 16, generator=g, dtype=torch.float64) / 4 for k in ("w0", "w1")}
    x = torch.randn(8, 16, generator=g, dtype=torch.float64)
    start = time.monotonic()
    with engine.parallelize(loss_fn, params, x, schedule="1f1b", stages=2, microbatches=2, calibrate=True,
                            timeout=TIMEOUT) as step:
        waited = time.monotonic() - start
        loss, _ = step(step.shard(params), x)
    print(f"CALIBRATED rank {world.rank} {waited:.1f} {float(loss):.12f}", flush=True)


if __name__ == "__main__":
    main()
