"""The host's own work in a step, with the stage programs taken out: what a GPU waits for where it outruns the host.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/executor_overhead.py [--model resnet101x1] [--steps 30]

Builds a wide ResNet with BatchNorm in train mode (tiny width: many leaves, little compute) as one stage, fx,
8 microbatches, runs one real step, then replaces every stage program by a stub that hands back the outputs it
recorded. What is left is fnpipe's host work: the executor's instruction loop (operands, accumulators, frees,
the loss and aux sums), splitting the batch, the input checks, the pytrees and BatchNorm's deferred update.
Prints the median step and its parts in ms (per step and per microbatch), to compare two versions side by side.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from examples.resnet_model import build  # noqa: E402


def replaying(executor: engine.execution.executor.Executor) -> None:  # type: ignore[name-defined]
    """Wrap every compiled part to record its outputs once, then hand them back in the same order every step."""
    for key, part in list(executor.parts.items()):
        executor.parts[key] = _Replay(part)


class _Replay:
    def __init__(self, part) -> None:
        self.part, self.recorded, self.k = part, [], 0

    def __call__(self, *args):
        if self.part is not None:
            out = self.part(*args)
            self.recorded.append(out)
            return out
        out = self.recorded[self.k % len(self.recorded)]
        self.k += 1
        return out

    def replay(self) -> None:
        self.part, self.k = None, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet101x1")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="also print the top functions by own time")
    args = ap.parse_args()
    torch.manual_seed(0)
    m = args.microbatches
    net = build(args.model, classes=10, base=4).train(True)
    fn, variables = engine.functionalize(net, loss=F.cross_entropy)
    x, y = torch.randn(2 * m, 3, 32, 32), torch.randint(0, 10, (2 * m,))
    step = engine.parallelize(fn, variables, x, y, schedule="1f1b", microbatches=m, has_aux=True, compiler="fx",
                              min_microbatch_size=1)
    local = step.shard(variables)
    step(local, x, y)
    replaying(step.executor)
    step(local, x, y)  # records
    for part in step.executor.parts.values():
        part.replay()
    run = step.executor.run
    inside: list[float] = []

    def timed_run(*a, **k):
        t = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            inside.append(time.perf_counter() - t)

    step.executor.run = timed_run  # type: ignore[method-assign]
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step(local, x, y)
        times.append(time.perf_counter() - t)
    whole, executor = statistics.median(times), statistics.median(inside)
    leaves = len(step.executor.params)
    print(f"{args.model} (BatchNorm train, {leaves} parameter and buffer leaves), one stage, {m} microbatches, "
          f"programs replayed: step {whole * 1e3:.2f} ms = executor {executor * 1e3:.2f} ms "
          f"({executor / m * 1e3:.3f} ms a microbatch) + the rest {(whole - executor) * 1e3:.2f} ms "
          f"(batch split, checks, pytrees, BatchNorm's update)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            step(local, x, y)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    step.close()


if __name__ == "__main__":
    main()
