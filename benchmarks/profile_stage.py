"""Where one stage's time goes on one GPU: fnpipe's programs against plain torch.func.grad, kernel by kernel.

    PYTHONPATH=. python benchmarks/profile_stage.py [--large] [--calibrate cal.json] [--out $OUT/profile.json]
                                                    [--variants fx,cheap,inductor]

The whole base GPT as one stage (8 microbatches of 4, bf16), as in gpu_pipeline.py's one-GPU rows:
1. `step.traced`: each F and BW program timed with CUDA events, against the plan's predicted times;
2. torch.profiler over two steps of each: GPU kernel time by kernel (top 25, and the sum), and the share
   of the step the GPU was busy (the rest is host-side launch gaps);
3. median step time of each variant against torch.func.grad's: "fx" as shipped, "remat<N>" with cheap
   recomputation reaching back at most N equations (ir.autodiff.CHAIN_DEPTH), "inductor" compiled.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu_pipeline  # noqa: E402
from engine import report  # noqa: E402


def kernel_times(fn: Callable[[], Any], steps: int = 2) -> tuple[dict[str, tuple[float, int]], float]:
    """Seconds and launches per GPU kernel name over `steps` calls of `fn`, and the wall seconds."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time_total * 1e-6 / steps
            per[e.name][1] += 1
    wall = (max(e.time_range.end for e in prof.events()) - min(e.time_range.start for e in prof.events())) * 1e-6
    return {k: (t, n // steps) for k, (t, n) in per.items()}, wall / steps


def variant_step(b: gpu_pipeline.Bench, variant: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    """A one-stage fnpipe step built as `variant` says, as a function returning the loss: "fx" (nothing
    recomputed), "cheap" (fx with norms and pointwise chains recomputed: the level a tight memory limit or
    inductor picks), "inductor"."""
    step = gpu_pipeline.alone_step(b, "1f1b", compiler="inductor" if variant == "inductor" else "fx",
                                   fused_recompute=True if variant == "cheap" else None)
    local = step.shard(b.params)
    return lambda: step(local, x, y)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: the tiny GPT, no kernel profile")
    ap.add_argument("--calibrate", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default="fx", help="comma separated: fx, cheap, inductor")
    args = ap.parse_args()
    argv = ["--single", "--warmup", "2", "--steps", "3"] + (["--large"] if args.large else []) + \
        (["--tiny"] if args.tiny else []) + \
        (["--calibrate", args.calibrate] if args.calibrate else [])
    b = gpu_pipeline.Bench(gpu_pipeline.parse_args(argv))
    step = gpu_pipeline.alone_step(b, "1f1b")
    local = step.shard(b.params)
    x, y = b.tokens.to(b.world.device), b.targets.to(b.world.device)
    for _ in range(2):
        step(local, x, y)
    _, _, spans = step.traced(local, x, y)
    print(report.compare(step, spans), flush=True)
    grad = gpu_pipeline.grad_step(b)
    if b.world.device.type == "cuda":
        print_kernels(b, lambda: step(local, x, y), grad, args.out)
    steps = {"torch.func.grad": grad, "fx": lambda: step(local, x, y)[0]}
    for variant in [v for v in args.variants.split(",") if v and v != "fx"]:
        steps[variant] = variant_step(b, variant, x, y)
    times = {name: b.measure(fn, loss_of=float, label=name, across_ranks=False).median for name, fn in steps.items()}
    print("\nvariant              s/step   / torch.func.grad")
    for name, t in times.items():
        print(f"{name:18s} {t:8.4f}   {t / times['torch.func.grad']:.3f}")


def print_kernels(b: gpu_pipeline.Bench, ours_fn: Callable[[], Any], grad: Callable[[], Any], out: str | None) -> None:
    """The kernel table: fnpipe's step against torch.func.grad's, largest kernels first."""
    ours, ours_wall = kernel_times(ours_fn)
    theirs, theirs_wall = kernel_times(grad)
    names = sorted(set(ours) | set(theirs), key=lambda k: -max(ours.get(k, (0, 0))[0], theirs.get(k, (0, 0))[0]))
    print(f"\n{'fnpipe ms':>10} {'n':>5} {'grad ms':>10} {'n':>5}  kernel (per step of {b.m} microbatches)")
    for k in names[:25]:
        (a, na), (g, ng) = ours.get(k, (0.0, 0)), theirs.get(k, (0.0, 0))
        print(f"{a * 1e3:10.2f} {na:5d} {g * 1e3:10.2f} {ng:5d}  {k[:110]}")
    busy_ours, busy_theirs = sum(t for t, _ in ours.values()), sum(t for t, _ in theirs.values())
    print(f"{busy_ours * 1e3:10.2f} {sum(n for _, n in ours.values()):5d} {busy_theirs * 1e3:10.2f} "
          f"{sum(n for _, n in theirs.values()):5d}  all kernels")
    print(f"step wall ms: fnpipe {ours_wall * 1e3:.2f} (GPU busy {busy_ours / ours_wall:.1%}), "
          f"grad {theirs_wall * 1e3:.2f} (GPU busy {busy_theirs / theirs_wall:.1%})", flush=True)
    if out:
        Path(out).write_text(json.dumps({"fnpipe": ours, "grad": theirs, "fnpipe_wall": ours_wall,
                                         "grad_wall": theirs_wall}, indent=1))


if __name__ == "__main__":
    main()
