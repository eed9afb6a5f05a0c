"""Planning time at scale: the two plans the issues set a time for, each timed with its peak RSS.

    PYTHONPATH=. python benchmarks/plan_scale.py                     # both targets
    PYTHONPATH=. python benchmarks/plan_scale.py --target llama70b   # issue 18: <= 60 s, <= 2 GB RSS, fits
    PYTHONPATH=. python benchmarks/plan_scale.py --target resnet152x8  # issue 24: <= 30 s on 2 cores
    PYTHONPATH=. python benchmarks/plan_scale.py --profile            # and the top of a cProfile

`llama70b`: Llama-2-70B's shape (80 layers, d 8192, GQA 8 kv heads, seq 4096, batch 1,024) for 1,024
GPUs of 80 GB (h100 profile), bf16 params with fp32 master weights and fp32 AdamW moments, ZeRO-1 "auto"
(benchmarks/plan_70b.py builds it); `--stages/--dp/--microbatches/--recompute` as there (default: the
layout the engineer who built the recipe measured, 16 stages x dp 64, 16 microbatches, recompute on).
`resnet152x8`: RaNNC's flagship, BiT-style bottleneck ResNet-152 with every width x8 (3.7 B params),
eval-mode BatchNorm, batch 128 at 224x224, for 32 ranks x 32 GB, layout "auto". Both are built on the
meta device: nothing is allocated. Each target runs in its own process so its peak RSS is its own.
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
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine  # noqa: E402
from engine.planning.recipe import Recipe  # noqa: E402


def _bottleneck(cin: int, inner: int, stride: int) -> nn.Module:
    class Bottleneck(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            out = inner * 4
            self.conv1, self.bn1 = nn.Conv2d(cin, inner, 1, bias=False), nn.BatchNorm2d(inner)
            self.conv2, self.bn2 = nn.Conv2d(inner, inner, 3, stride, 1, bias=False), nn.BatchNorm2d(inner)
            self.conv3, self.bn3 = nn.Conv2d(inner, out, 1, bias=False), nn.BatchNorm2d(out)
            self.down = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                         if stride != 1 or cin != out else None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.bn1(self.conv1(x)))
            h = F.relu(self.bn2(self.conv2(h)))
            h = self.bn3(self.conv3(h))
            return F.relu(h + (x if self.down is None else self.down(x)))
    return Bottleneck()


def wide_resnet(depths: tuple[int, ...] = (3, 8, 36, 3), width: int = 8, classes: int = 1000) -> nn.Module:
    """torchvision's ResNet v1.5 layout with every channel count times `width` (BiT's resnet152x8 by
    default); examples/resnet_model.py (branch bn-eval) builds the same by name."""
    c = 64 * width
    layers: list[nn.Module] = [nn.Conv2d(3, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    stages, cin = [], c
    for k, n in enumerate(depths):
        inner = c * 2 ** k
        stages.append(nn.Sequential(*[_bottleneck(cin if i == 0 else inner * 4, inner, 2 if i == 0 and k else 1)
                                      for i in range(n)]))
        cin = inner * 4
    return nn.Sequential(nn.Sequential(*layers), nn.Sequential(*stages), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(cin, classes))


def resnet_target(args: argparse.Namespace) -> tuple[Callable[[], Any], str]:
    with torch.device("meta"):
        model = wide_resnet().to(torch.bfloat16).eval()
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    x = torch.empty(128, 3, 224, 224, dtype=torch.bfloat16, device="meta")
    y = torch.empty(128, dtype=torch.int64, device="meta")
    numel = sum(p.numel() for p in model.parameters())
    run = lambda: engine.plan(fn, variables, x, y, world_size=32, device="h100", memory_limit=32 * 2**30,  # noqa: E731
                              stages="auto", dp="auto", microbatches="auto")
    return run, f"resnet152x8 ({numel / 1e9:.2f} B params, eval-mode BN), 32 ranks x 32 GiB, batch 128 at 224x224"


def llama_target(args: argparse.Namespace) -> tuple[Callable[[], Any], str]:
    import plan_70b

    cfg = plan_70b.config()
    params = plan_70b.params_of(cfg, 4096)
    tokens = torch.empty(1024, 4096, dtype=torch.long, device="meta")
    recipe = Recipe(optimizer="adamw", master_dtype=torch.float32, shard_optimizer="auto")
    count = lambda v: v if v == "auto" else int(v)  # noqa: E731
    recompute = {"auto": "auto", "true": True, "false": False}[args.recompute]
    run = lambda: engine.plan(plan_70b.make_loss(cfg), params, tokens, tokens, world_size=1024, device="h100",  # noqa: E731
                              stages=count(args.stages), dp=count(args.dp), microbatches=count(args.microbatches),
                              recipe=recipe, recompute=recompute)
    numel = sum(x.numel() for x in torch.utils._pytree.tree_leaves(params))
    return run, (f"llama70b ({numel / 1e9:.1f} B params, fp32 AdamW), 1024 x h100 80 GB; stages {args.stages}, "
                 f"dp {args.dp}, microbatches {args.microbatches}, recompute {args.recompute}")


TARGETS = {"llama70b": llama_target, "resnet152x8": resnet_target}


def run_one(args: argparse.Namespace) -> None:
    run, what = TARGETS[args.target](args)
    prof = cProfile.Profile() if args.profile else None
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
    print(f"\n{what}: planned in {seconds:.1f} s, peak RSS {rss:.2f} GiB; {plan.num_stages} stages x dp {plan.dp}, "
          f"{plan.microbatches} microbatches; largest rank {max(plan.rank_memory) / 2**30:.1f} of "
          f"{plan.memory_limit / 2**30:.1f} GiB: {'fits' if fits else 'DOES NOT FIT'}", flush=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=[*TARGETS, "all"], default="all")
    ap.add_argument("--stages", default="16")
    ap.add_argument("--dp", default="64")
    ap.add_argument("--microbatches", default="16")
    ap.add_argument("--recompute", default="true", choices=["auto", "true", "false"])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.target != "all":
        return run_one(args)
    for target in TARGETS:  # a process each: peak RSS per target
        cmd = [sys.executable, __file__, "--target", target, "--stages", args.stages, "--dp", args.dp,
               "--microbatches", args.microbatches, "--recompute", args.recompute] + (["--profile"] if args.profile else [])
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
