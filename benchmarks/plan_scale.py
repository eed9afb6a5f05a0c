"""Planning time at scale: the plans the issues set a time for, each timed with its peak RSS.

    PYTHONPATH=. python benchmarks/plan_scale.py                       # both targets, a process each
    PYTHONPATH=. python benchmarks/plan_scale.py --target llama70b     # issue 18: <= 60 s, <= 2 GB RSS, fits
    PYTHONPATH=. python benchmarks/plan_scale.py --target resnet152x8  # issue 24: <= 30 s on 2 cores
    PYTHONPATH=. python benchmarks/plan_scale.py --target resnet152x8 --mode train   # BatchNorm in train mode
    PYTHONPATH=. python benchmarks/plan_scale.py --profile             # and the top of a cProfile
    PYTHONPATH=. python benchmarks/plan_scale.py --target llama70b --stages auto --dp auto --microbatches auto \
        --recompute auto                                               # every count chosen by the planner

`llama70b`: Llama-2-70B's shape (80 layers, d 8192, GQA 8 kv heads, seq 4096, batch 1,024) for 1,024
GPUs of 80 GB (h100 profile), bf16 params with fp32 master weights and fp32 AdamW moments, ZeRO-1 "auto"
(the model: benchmarks/plan_70b.py); `--stages/--dp/--microbatches/--recompute` (default: the layout the
engineer who built the recipe measured, 16 stages x dp 64, 16 microbatches, recompute on).
`resnet152x8` (or any `--model` examples/resnet_model.py names): RaNNC's flagship, BiT-style bottleneck
ResNet-152 with every width x8 (3.7 B params), BatchNorm in eval mode (`--mode train`: train mode, whose
microbatch floor of 16 applies unless `--min-microbatch`), batch 128 at 224x224, for 32 ranks x 32 GB,
layout "auto". Every model is built on the meta device: nothing is allocated. `timed_plan` is the one
runner the other plan_*.py scripts share.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine  # noqa: E402
from engine.planning.recipe import Recipe  # noqa: E402
from examples.resnet_model import build  # noqa: E402


def timed_plan(run: Callable[[], Any], what: str, *, profile: bool = False) -> Any:
    """Run `run()` (an `engine.plan` call), print the plan, its seconds, the peak RSS and whether it fits."""
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof is not None:
        prof.enable()
    plan = run()
    if prof is not None:
        prof.disable()
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(plan)
    fits = max(plan.rank_memory) <= plan.memory_limit
    print(f"\n{what}: planned in {seconds:.1f} s, peak RSS {rss:.2f} GiB; {plan.pipeline_depth} stages x dp {plan.dp}, "
          f"{plan.microbatches} microbatches, ZeRO-1 {plan.shard_optimizer}; largest rank "
          f"{max(plan.rank_memory) / 2**30:.1f} of {plan.memory_limit / 2**30:.1f} GiB: "
          f"{'fits' if fits else 'DOES NOT FIT'}", flush=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    return plan


def _count(v: str) -> int | str:
    return v if v == "auto" else int(v)


def resnet_target(args: argparse.Namespace) -> tuple[Callable[[], Any], str]:
    with torch.device("meta"):
        model = build(args.model).to(torch.bfloat16).train(args.mode == "train")
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    x = torch.empty(args.batch, 3, args.image, args.image, dtype=torch.bfloat16, device="meta")
    y = torch.empty(args.batch, dtype=torch.int64, device="meta")
    numel = sum(p.numel() for p in model.parameters())
    run = lambda: engine.plan(fn, variables, x, y, world_size=args.world, device="h100",  # noqa: E731
                              memory_limit=int(args.memory_gb * 2**30), schedule=args.schedule,
                              stages=_count(args.stages), dp=_count(args.dp), microbatches=_count(args.microbatches),
                              has_aux=args.mode == "train", min_microbatch_size=args.min_microbatch)
    return run, (f"{args.model} ({numel / 1e9:.2f} B params, {args.mode}-mode BN), {args.world} ranks x "
                 f"{args.memory_gb:g} GB, batch {args.batch} at {args.image}x{args.image}")


def llama_target(args: argparse.Namespace) -> tuple[Callable[[], Any], str]:
    import plan_70b

    cfg = plan_70b.config(layers=args.layers)
    params = plan_70b.params_of(cfg, args.seq)
    tokens = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    recipe = Recipe(optimizer="adamw", master_dtype=torch.float32, shard_optimizer="auto")
    recompute = {"auto": "auto", "true": True, "false": False}[args.recompute]
    run = lambda: engine.plan(plan_70b.make_loss(cfg), params, tokens, tokens, world_size=args.world,  # noqa: E731
                              device="h100", stages=_count(args.stages), dp=_count(args.dp),
                              microbatches=_count(args.microbatches), recipe=recipe, recompute=recompute,
                              schedule=args.schedule)
    numel = sum(x.numel() for x in torch.utils._pytree.tree_leaves(params))
    return run, (f"llama70b ({numel / 1e9:.1f} B params, fp32 AdamW), {args.world} x h100 80 GB; stages {args.stages}, "
                 f"dp {args.dp}, microbatches {args.microbatches}, recompute {args.recompute}")


TARGETS = {"llama70b": llama_target, "resnet152x8": resnet_target}
# each target's defaults where they differ (the llama70b layout the recipe's engineer measured)
DEFAULTS = {"llama70b": dict(stages="16", dp="64", microbatches="16", recompute="true", world=1024, batch=1024),
            "resnet152x8": dict(stages="auto", dp="auto", microbatches="auto", world=32, batch=128)}


def parser(description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    ap.add_argument("--stages")
    ap.add_argument("--dp")
    ap.add_argument("--microbatches")
    ap.add_argument("--recompute", choices=["auto", "true", "false"])
    ap.add_argument("--world", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--layers", type=int, default=80, help="llama70b: layers")
    ap.add_argument("--seq", type=int, default=4096, help="llama70b: sequence length")
    ap.add_argument("--model", default="resnet152x8", help="resnet: a name examples/resnet_model.py builds")
    ap.add_argument("--mode", choices=("train", "eval"), default="eval", help="resnet: BatchNorm's mode")
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--memory-gb", type=float, default=32.0, help="resnet: memory per rank")
    ap.add_argument("--min-microbatch", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    return ap


def run_target(args: argparse.Namespace) -> Any:
    for key, value in DEFAULTS[args.target].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    run, what = TARGETS[args.target](args)
    return timed_plan(run, what, profile=args.profile)


def main() -> None:
    args = parser().parse_args()
    if args.target != "all":
        run_target(args)
        return
    for target in TARGETS:  # a process each: peak RSS per target
        cmd = [sys.executable, __file__, *sys.argv[1:], "--target", target]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
