"""Does a step started again in the same process run slower? The same plan started `--starts` times in turn.

    PYTHONPATH=. torchrun --nproc_per_node 4 benchmarks/restarts.py --family llama --schedule zbv

Session 12 (4 x H100, Llama zbv): a step started a third time in one process (parallelize's re-split, then the
planner's cuts again) ran 0.1197 s against 0.1072 s for the same cuts started once in the same launch. Here
each start is `engine.parallelize(..., rebalance=False)` on the same model, batch and options (the planner's
cuts, the same programs from the compile cache), timed over `--steps` steps, then closed; between starts it
prints what the device holds (allocated and reserved bytes). Starts that slow down with the same cuts point
at what a closed step leaves behind (NCCL communicators, memory, compiled programs); steady ones clear it.
CPU smoke: `--tiny` (gloo, fp32).
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from benchmarks.families import family  # noqa: E402
from benchmarks.step_timer import measure  # noqa: E402


def held(device: torch.device) -> str:
    if device.type != "cuda":
        return "-"
    return (f"allocated {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB, "
            f"reserved {torch.cuda.memory_reserved(device) / 2**30:.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama", choices=("gpt", "llama"))
    ap.add_argument("--schedule", default="zbv")
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke sizes")
    args = ap.parse_args()
    world = engine.init()
    fam = family(args.family, "tiny" if args.tiny else "base")
    dtype = torch.float32 if args.tiny or world.device.type == "cpu" else torch.bfloat16
    params = fam.params(dtype, world.device, seed=0)
    tokens, targets = fam.batch(args.microbatches * args.microbatch_size, seed=1)
    rows = []
    for start in range(args.starts):
        with engine.parallelize(fam.loss_fn(), params, tokens, targets, schedule=args.schedule,
                                microbatches=args.microbatches, rebalance=False) as step:
            local = step.shard(params)
            m = measure(lambda: step(local, tokens, targets), loss_of=lambda out: float(out[0]), warmup=2,
                        steps=args.steps, device=world.device)
            rows.append((start + 1, list(step.plan.cuts), m.median))
            del local
        gc.collect()
        if world.rank == 0:
            print(f"start {start + 1}: {m.median:.4f} s/step, cuts {list(step.plan.cuts)}; after close: "
                  f"{held(world.device)}", flush=True)
    if world.rank == 0:
        print(f"\n{fam.describe()}; {args.schedule}, {args.microbatches} x {args.microbatch_size}")
        print("| start | cuts | s/step | x first |\n|---|---|---|---|")
        for n, cuts, s in rows:
            print(f"| {n} | {cuts} | {s:.4f} | {s / rows[0][2]:.3f} |")


if __name__ == "__main__":
    main()
