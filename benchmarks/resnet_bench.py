"""The wide-ResNet rows: fnpipe against PyTorch DDP and torch.distributed.pipelining GPipe, in one launch.

    # GPUs (the lead runs this): 2 x H200, bf16, BatchNorm in train mode
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/resnet_bench.py --model resnet101x4 --batch 128 \
        --dtype bfloat16 --microbatches 8 --steps 10 [--calibrate] [--compiler fx,inductor] [--json out.json]
    # CPU, tiny (what tests run): 2 processes over gloo
    PYTHONPATH=. mpirun -n 2 python benchmarks/resnet_bench.py --tiny --steps 2

Rows (each: images/s, seconds per step (median of --steps after --warmup), peak memory per rank):
  fnpipe   (one row per --compiler) `engine.parallelize` of `engine.functionalize(model)` (BN in train mode: running statistics as
           state), 2 stages x dp 1 by default, its predicted step time beside the measured one
  ddp      DistributedDataParallel, every rank the whole model and 1/world of the batch (BN per rank)
  gpipe    torch.distributed.pipelining ScheduleGPipe, the model cut by hand into `world` stages at the
           block boundary nearest half the parameters, the same microbatches as fnpipe
No optimizer step in any row: forward + backward + grad sync only, the same work in each, the batch on the device
in each (fnpipe's row also times its step given the batch on the host: `host_batch_seconds`). Peak memory is
`torch.cuda.max_memory_allocated` (GPU) or "-" on CPU. Rows run one after the other, each freeing the last.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from examples.resnet_model import build  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet101x4")
    ap.add_argument("--tiny", action="store_true", help="resnet50x1 of stem width 4, 32x32, batch 32 (CPU)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b", help="fnpipe's schedule")
    ap.add_argument("--stages", default=None, help="fnpipe's stages: a count or auto (default: one per rank)")
    ap.add_argument("--dp", default=None, help="fnpipe's dp: a count or auto (with --stages auto --dp auto the "
                    "planner may choose plain data parallelism, as DDP runs)")
    ap.add_argument("--bn", choices=("train", "eval"), default="train")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", default="fnpipe,ddp,gpipe")
    ap.add_argument("--calibrate", nargs="?", const=True, default=False,
                    help="fnpipe: time every op on the GPU before planning (a path: keep the table there, reuse it)")
    ap.add_argument("--compiler", default="fx", help="fnpipe's stage compiler; several (fx,inductor): one fnpipe row each")
    ap.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = ap.parse_args()
    if args.tiny:
        args.model, args.batch, args.image, args.base, args.dtype = "resnet50x1", 32, 32, 4, "float32"
        args.microbatches = 2
    else:
        args.base = 64
    return args


def model_of(args: argparse.Namespace, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    net = build(args.model, classes=1000 if not args.tiny else 10, base=args.base)
    return net.to(device=device, dtype=getattr(torch, args.dtype)).train(args.bn == "train")


def data(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g).to(device, getattr(torch, args.dtype))
    return x, torch.randint(0, 10 if args.tiny else 1000, (args.batch,), generator=g).to(device)


def timed(run: Callable[[], Any], args: argparse.Namespace, device: torch.device) -> tuple[float, float | None]:
    """Median seconds of `run` over --steps after --warmup, and the peak memory (GiB) on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for k in range(args.warmup + args.steps):
        if dist.is_initialized():  # a world of one has no process group
            dist.barrier()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if k >= args.warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak


def fnpipe_row(args: argparse.Namespace, world: engine.World, compiler: str) -> dict[str, Any]:
    fn, variables = engine.functionalize(model_of(args, torch.device("cpu")), loss=F.cross_entropy)
    x, y = data(args, torch.device("cpu"))
    train = args.bn == "train"
    layout = {k: v if v in (None, "auto") else int(v) for k, v in (("stages", args.stages), ("dp", args.dp))}
    step = engine.parallelize(fn, variables, x, y, schedule=args.schedule, microbatches=args.microbatches, **layout,
                              has_aux=train, calibrate=args.calibrate, compiler=compiler, min_microbatch_size=1)
    local = step.shard(variables)
    on_device = x.to(world.device), y.to(world.device)  # as the DDP and GPipe rows get theirs
    seconds, peak = timed(lambda: step(local, *on_device), args, world.device)
    host_seconds, _ = timed(lambda: step(local, x, y), args, world.device)
    plan, from_programs = step.plan, step.predicted_step_time
    replayed = [round(f.peak / 2**30, 2) for f in step.memory()]
    against = step.against_plan()
    moved = None if step.rebalanced is None else str(step.rebalanced)
    step.close()
    return {"row": f"fnpipe {compiler}", "seconds": seconds, "host_batch_seconds": host_seconds, "peak_gib": peak,
            "predicted": plan.predicted_step_time,
            "program_predicted": from_programs, "predicted_peak_gib_per_rank": replayed, "against_plan": against,
            "rebalanced": moved,
            "layout": f"{plan.schedule} {plan.num_stages} stages x dp {plan.dp}, {plan.microbatches} x "
                      f"{plan.microbatch_size}", "cuts": list(plan.cuts)}


def ddp_row(args: argparse.Namespace, world: engine.World) -> dict[str, Any]:
    device = world.device
    net = model_of(args, device)
    if dist.is_initialized():  # a world of one: the plain module (eager PyTorch on one device)
        net = nn.parallel.DistributedDataParallel(net, device_ids=[device] if device.type == "cuda" else None)
    x, y = data(args, device)
    share = args.batch // world.size
    xs, ys = x[world.rank * share:(world.rank + 1) * share], y[world.rank * share:(world.rank + 1) * share]

    def run() -> None:
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(xs), ys).backward()

    seconds, peak = timed(run, args, device)
    return {"row": "ddp", "seconds": seconds, "peak_gib": peak, "layout": f"dp {world.size}, {share} per rank"}


def split_by_params(net: nn.Module, parts: int) -> list[nn.Sequential]:
    """The model's blocks (stem, each bottleneck, head) cut into `parts` runs of about equal parameters."""
    blocks: list[nn.Module] = [net.stem, *[b for stage in net.layers for b in stage],
                               nn.Sequential(net.pool, nn.Flatten(), net.head)]
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total, out, acc, start = sum(sizes), [], 0, 0
    for i, s in enumerate(sizes):
        acc += s
        if len(out) < parts - 1 and acc >= total * (len(out) + 1) / parts:
            out.append(nn.Sequential(*blocks[start:i + 1]))
            start = i + 1
    out.append(nn.Sequential(*blocks[start:]))
    return out


def gpipe_row(args: argparse.Namespace, world: engine.World) -> dict[str, Any]:
    from torch.distributed import pipelining

    device = world.device
    part = split_by_params(model_of(args, torch.device("cpu")), world.size)[world.rank].to(device)
    stage = pipelining.PipelineStage(part, world.rank, world.size, device)
    schedule = pipelining.ScheduleGPipe(stage, args.microbatches, loss_fn=F.cross_entropy)
    x, y = data(args, device)
    first, last = world.rank == 0, world.rank == world.size - 1

    def run() -> None:
        part.zero_grad(set_to_none=True)
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    seconds, peak = timed(run, args, device)
    return {"row": "gpipe", "seconds": seconds, "peak_gib": peak,
            "layout": f"torch.distributed.pipelining GPipe, {world.size} stages, {args.microbatches} microbatches"}


ROWS = {"ddp": ddp_row, "gpipe": gpipe_row}


def rows_of(args: argparse.Namespace) -> list[tuple[str, Callable[[argparse.Namespace, engine.World], dict[str, Any]]]]:
    """(name, run) for each row of --rows in order, "fnpipe" once per compiler of --compiler."""
    out = []
    for name in args.rows.split(","):
        if name == "fnpipe":
            out += [(f"fnpipe {c}", functools.partial(fnpipe_row, compiler=c)) for c in args.compiler.split(",")]
        else:
            out.append((name, ROWS[name]))
    return out


def main() -> None:
    args = parse_args()
    world = engine.init()
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    results = []
    for name, run in rows_of(args):
        if world.rank == 0:
            print(f"{name}: running", flush=True)
        row = run(args, world)
        peaks = [torch.tensor([-1.0 if row["peak_gib"] is None else row["peak_gib"]])]
        gathered = [torch.zeros(1, device=world.device) for _ in range(world.size)]
        if dist.is_initialized():
            dist.all_gather(gathered, peaks[0].to(world.device))
        else:
            gathered = peaks
        row["peak_gib_per_rank"] = [round(float(t), 2) for t in gathered]
        row["images_per_s"] = args.batch / row["seconds"]
        results.append(row)
        if world.device.type == "cuda":
            torch.cuda.empty_cache()
        if world.rank == 0:
            print(row_text(row), flush=True)  # as it comes: a launch cut short keeps what it measured
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "rows": results}, indent=1))
    if world.rank == 0:
        print(f"{args.model} batch {args.batch} at {args.image}x{args.image}, {args.dtype}, BN in {args.bn} mode, "
              f"{world.size} ranks ({world.device.type})")
        for r in results:
            print(row_text(r))


def row_text(r: dict[str, Any]) -> str:
    pred = f", predicted {r['predicted']:.4f} s (measured {r['seconds'] / r['predicted']:.2f} x that)" \
        if "predicted" in r else ""
    if r.get("program_predicted"):
        pred += (f", from the measured programs {r['program_predicted']:.4f} s (measured "
                 f"{r['seconds'] / r['program_predicted']:.2f} x), replayed peak GiB {r['predicted_peak_gib_per_rank']}")
    lines = [f"  {r['row']:15s} {r['images_per_s']:9.1f} images/s  {r['seconds']:.4f} s/step  peak GiB "
             f"{r['peak_gib_per_rank']}{pred}  [{r['layout']}]"]
    if r.get("host_batch_seconds"):
        lines.append(f"    the batch on the host: {r['host_batch_seconds']:.4f} s/step")
    if r.get("rebalanced"):
        lines.append(f"    {r['rebalanced']}")
    if r.get("against_plan"):
        lines.append("    " + r["against_plan"].replace("\n", "\n    "))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
