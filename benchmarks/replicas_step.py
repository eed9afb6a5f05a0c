"""Replicas per stage, measured: a model with one layer no cut can split, equal stages against the planner's
unequal replicas, in one launch; predicted and measured step time of each.

    mpirun -n 4 python benchmarks/replicas_step.py --width 8192 --batch 256    # 4 GPUs (bf16)
    mpirun -n 3 python benchmarks/replicas_step.py                             # CPU, tiny (float32)
Rank 0 prints one JSON line per layout: replicas, order, microbatches, predicted and median measured seconds.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import engine
from benchmarks.step_timer import measure


def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["wide"])
    for w in params["narrow"]:
        h = torch.tanh(h @ w)
    return F.mse_loss(h, y)


def model(width: int, batch: int, device: torch.device, dtype: torch.dtype) -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) / s[0] ** 0.5).to(device, dtype)  # noqa: E731
    params = {"wide": rnd(width, width), "narrow": [rnd(width, 64), rnd(64, 64), rnd(64, 4)]}
    return params, rnd(batch, width), rnd(batch, 4)


def run(label: str, params: dict, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace, **options) -> dict:
    with engine.parallelize(loss_fn, params, x, y, microbatches="auto", **options) as step:
        local = step.shard(params)
        m = measure(lambda: step(local, x, y), loss_of=lambda out: float(out[0]), warmup=args.warmup,
                    steps=args.steps, device=step.world.device, label=label)
        plan = step.plan
    return {"layout": label, "replicas": list(plan.replicas), "order": plan.replica_order, "dp": plan.dp,
            "microbatches": plan.microbatches, "predicted_s": plan.predicted_step_time, "measured_s": m.median,
            "equal_predicted_s": plan.equal_step_time or None, "peak_bytes": m.peak_bytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    world = engine.init()
    dtype = torch.bfloat16 if world.device.type == "cuda" else torch.float32
    params, x, y = model(args.width, args.batch, world.device, dtype)
    rows = [run("equal", params, x, y, args, stages=world.size, dp=1),
            run("auto", params, x, y, args, stages="auto", dp=1)]
    if world.rank == 0:
        for row in rows:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
