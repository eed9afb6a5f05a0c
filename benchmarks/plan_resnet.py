"""Plan time of RaNNC's flagship: `resnet152x8` (3.7 B params) for 32 ranks x 32 GB, batch 128 at 224x224.

    PYTHONPATH=. python benchmarks/plan_resnet.py [--model resnet152x8] [--world 32] [--batch 128]
                                                  [--mode train|eval] [--memory-gb 32] [--profile]

Built on the meta device (nothing of its 15 GB is allocated), planned in one CPU process with stages, dp
and microbatches "auto". Prints each phase's seconds (build + functionalize, the whole `engine.plan`),
the plan and the peak RSS; `--profile` adds the top of a cProfile by cumulative time (tracing, block
finding, the search). `--mode train` plans BatchNorm in train mode (its default microbatch floor of 16
applies; `--min-microbatch` lowers it), `eval` the issue's 107 s measurement (eval-mode BN).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from examples.resnet_model import build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet152x8")
    ap.add_argument("--world", type=int, default=32)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--mode", choices=("train", "eval"), default="eval")
    ap.add_argument("--memory-gb", type=float, default=32.0)
    ap.add_argument("--device", default="h100", help="device profile for speed (memory: --memory-gb)")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--min-microbatch", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    start = time.perf_counter()
    with torch.device("meta"):
        model = build(args.model).to(torch.bfloat16).train(args.mode == "train")
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    x = torch.empty(args.batch, 3, args.image, args.image, dtype=torch.bfloat16, device="meta")
    y = torch.empty(args.batch, dtype=torch.int64, device="meta")
    built = time.perf_counter() - start
    prof = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if prof is not None:
        prof.enable()
    plan = engine.plan(fn, variables, x, y, world_size=args.world, schedule=args.schedule, stages="auto", dp="auto",
                       microbatches="auto", device=args.device, memory_limit=int(args.memory_gb * 2**30),
                       has_aux=args.mode == "train", min_microbatch_size=args.min_microbatch)
    if prof is not None:
        prof.disable()
    planned = time.perf_counter() - start
    print(plan)
    params = sum(p.numel() for p in model.parameters())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{args.model} ({params / 1e9:.2f} B params, BN in {args.mode} mode), {args.world} ranks x "
          f"{args.memory_gb:g} GB, batch {args.batch} at {args.image}x{args.image}: built in {built:.1f} s, "
          f"planned in {planned:.1f} s, peak RSS {rss:.2f} GB")
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
