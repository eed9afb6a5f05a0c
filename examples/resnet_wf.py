"""Train RaNNC's wide ResNets (`resnet50x1` ... `resnet152x8`) with fnpipe: BatchNorm in train mode,
synthetic ImageNet-shaped data, SGD with momentum (AdamW for --tiny), evaluation on the same plan.

    PYTHONPATH=. mpirun -n 2 python examples/resnet_wf.py --tiny              # CPU: narrow, 32x32, a minute
    PYTHONPATH=. mpirun -n 2 python examples/resnet_wf.py --model resnet101x4 --batch 64 --dtype bfloat16
    PYTHONPATH=. python examples/resnet_wf.py --plan-only --model resnet152x8 --world 32   # plan on a laptop

The data is learnable: each class has a fixed random image; a sample is its class's image plus noise
(the same on every rank for a given step: fnpipe takes the full batch on every rank). BatchNorm runs in
train mode: each microbatch is normalised with its own statistics and the running statistics come back
from every step as state (`(loss, state), grads = step(...)`, merged with `updated`), equal to one
update over the whole step's batch whatever the layout (engine/training/batchnorm.py). At the end the
model is evaluated on the same plan (`step.evaluate`: eval-mode BN with the running statistics).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.training.module import updated  # noqa: E402
from examples.resnet_model import build  # noqa: E402


class Images:
    """Batches of class templates plus noise; batch k is the same on every rank."""

    def __init__(self, classes: int, size: int, batch: int, *, noise: float = 1.0, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, 3, size, size, generator=gen)
        self.classes, self.batch, self.noise, self.seed = classes, batch, noise, seed

    def batch_at(self, k: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + k + 1)
        y = torch.randint(0, self.classes, (self.batch,), generator=gen)
        x = self.templates[y] + self.noise * torch.randn(self.templates[y].shape, generator=gen)
        return x.to(dtype), y


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50x1", help="resnet{50,101,152}x{width}")
    ap.add_argument("--tiny", action="store_true", help="CPU size: stem width 16 (not 64), 32x32 images, 10 classes")
    ap.add_argument("--base", type=int, default=None, help="stem channels before the width factor (64)")
    ap.add_argument("--image", type=int, default=None, help="image side (224)")
    ap.add_argument("--classes", type=int, default=None, help="classes (1000)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", default="auto", help="a count or auto (the floor: --min-microbatch)")
    ap.add_argument("--min-microbatch", type=int, default=None, help="rows per microbatch at least (16 with BN)")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--dp", type=int, default=None)
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default=None, help="adamw (tiny) or sgd with momentum")
    ap.add_argument("--lr", type=float, default=None, help="3e-3 (adamw), 0.1 x batch/256 (sgd)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--plan-only", action="store_true", help="plan on the meta device and print the plan")
    ap.add_argument("--world", type=int, default=None, help="with --plan-only: ranks to plan for")
    ap.add_argument("--device", default="h100", help="with --plan-only: device profile (memory, speed)")
    args = ap.parse_args(argv)
    args.base = args.base or (16 if args.tiny else 64)
    args.image = args.image or (32 if args.tiny else 224)
    args.classes = args.classes or (10 if args.tiny else 1000)
    args.optimizer = args.optimizer or ("adamw" if args.tiny else "sgd")
    args.lr = args.lr or (3e-3 if args.optimizer == "adamw" else 0.1 * args.batch / 256)
    args.microbatches = args.microbatches if args.microbatches == "auto" else int(args.microbatches)
    return args


def optimize(args: argparse.Namespace, params: Any, grads: Any, state: dict | None) -> tuple[Any, dict]:
    if args.optimizer == "adamw":
        return engine.optim.adamw(params, grads, state, lr=args.lr, weight_decay=1e-4)
    return engine.optim.sgd(params, grads, state, lr=args.lr, momentum=0.9, weight_decay=1e-4)


def plan_only(args: argparse.Namespace) -> None:
    with torch.device("meta"):
        model = build(args.model, classes=args.classes, base=args.base).train()
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    x = torch.empty(args.batch, 3, args.image, args.image, device="meta", dtype=getattr(torch, args.dtype))
    y = torch.empty(args.batch, dtype=torch.int64, device="meta")
    start = time.perf_counter()
    plan = engine.plan(fn, variables, x, y, world_size=args.world or 1, schedule=args.schedule, device=args.device,
                       microbatches=args.microbatches, stages=args.stages or "auto", dp=args.dp or "auto",
                       has_aux=True, min_microbatch_size=args.min_microbatch)
    print(plan)
    print(f"planned {args.model} for {args.world or 1} ranks in {time.perf_counter() - start:.1f} s")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plan_only:
        return plan_only(args)
    world = engine.init()
    say = print if world.rank == 0 else (lambda *a, **k: None)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = build(args.model, classes=args.classes, base=args.base).to(dtype).train()
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    data = Images(args.classes, args.image, args.batch)
    x, y = data.batch_at(0, dtype)
    step = engine.parallelize(fn, variables, x, y, schedule=args.schedule, microbatches=args.microbatches,
                              stages=args.stages, dp=args.dp, has_aux=True, min_microbatch_size=args.min_microbatch)
    say(step.plan)
    variables = step.shard(variables)
    state: dict[str, Any] | None = None
    losses: list[float] = []
    start = time.perf_counter()
    for k in range(args.steps):
        x, y = data.batch_at(k, dtype)
        (loss, stats), grads = step(variables, x, y)
        variables = updated(variables, stats)  # the new running statistics (None stays None off this rank)
        params, state = optimize(args, variables["params"], grads["params"], state)
        variables = {**variables, "params": params}
        losses.append(float(loss))
        last = losses[-1]
        if k % args.log_every == 0 or k == args.steps - 1:
            say(f"step {k:4d}/{args.steps} loss {last:.4f} ({(time.perf_counter() - start) / (k + 1):.3f} s/step)")
    x, y = data.batch_at(10_000, dtype)
    logits = step.evaluate(variables, x)  # forward-only on the same plan, BN in eval mode, every rank
    accuracy = float((logits.argmax(1) == y).float().mean())
    tail = sum(losses[-5:]) / len(losses[-5:])  # single steps are noisy: the mean of the last five
    say(f"done in {time.perf_counter() - start:.1f} s: loss {losses[0]:.4f} -> {tail:.4f} (mean of the last 5 "
        f"steps); eval accuracy {accuracy:.3f}")
    step.close()


if __name__ == "__main__":
    main()
