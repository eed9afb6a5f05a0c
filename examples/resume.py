"""Train, checkpoint at step k, stop, resume on another layout, and reach the uninterrupted run's loss.

    mpirun -n 2 python examples/resume.py --ckpt /tmp/ckpt --phase first   # 2 stages: reference run, then
                                                                           #   k steps, a checkpoint, stop
    python examples/resume.py --ckpt /tmp/ckpt --phase resume               # 1 rank, 1 stage: resume, compare
    mpirun -n 2 python examples/resume.py                                   # both in one job: 2 stages -> dp 2
    python examples/resume.py                                               # one rank: 2 stages -> 1 stage

The model is a small residual MLP in float64 trained with AdamW and global-norm clipping; batch i is
drawn from a generator seeded by i, so every run sees the same data. The checkpoint holds the params
and optimizer state by leaf name, so the resumed run may cut the model differently.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.nn.functional as F

import engine
from engine import checkpoint, optim

WIDTH, LAYERS, BATCH = 8, 4, 16
LR, CLIP = 3e-2, 1.0


def init_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / s[0] ** 0.5  # noqa: E731
    return {"inp": rnd(4, WIDTH), "blocks": [{"w": rnd(WIDTH, WIDTH), "b": torch.zeros(WIDTH, dtype=torch.float64)}
                                             for _ in range(LAYERS)], "out": rnd(WIDTH, 1)}


def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x @ params["inp"]
    for blk in params["blocks"]:
        h = h + torch.tanh(h @ blk["w"] + blk["b"])
    return F.mse_loss(h @ params["out"], y)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(BATCH, 4, generator=g, dtype=torch.float64)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def layout(world: int, phase: str) -> dict:
    """First run: a pipeline of `world` stages (2 stages on one rank when alone). Resume: dp 2 where
    the world allows, else one stage per rank; either way another cut of the model than the first."""
    if phase == "first":
        return dict(schedule="1f1b", stages=world) if world > 1 else \
            dict(schedule="interleaved-1f1b", stages=2, stages_per_rank=2)
    if world > 1 and world % 2 == 0:
        return dict(schedule="1f1b", stages=world // 2, dp=2)
    return dict(schedule="1f1b", stages=world)


def make_step(cfg: dict) -> engine.Step:
    return engine.parallelize(loss_fn, init_params(), *batch(0), microbatches=2, **cfg)


def train(step: engine.Step, params, state, start: int, stop: int) -> tuple[object, object, list[float]]:
    losses = []
    for i in range(start, stop):
        loss, grads = step(params, *batch(i))
        grads, _ = optim.clip_grad_norm(grads, CLIP, step=step)
        params, state = optim.adamw(params, grads, state, lr=LR)
        losses.append(loss.item())
    return params, state, losses


def final_loss(step: engine.Step, params) -> float:
    return step(params, *batch(-1))[0].item()


def first(ckpt: str, steps: int, stop_at: int, world: engine.World) -> None:
    cfg = layout(world.size, "first")
    step = make_step(cfg)
    params, _, ref = train(step, step.shard(init_params()), None, 0, steps)  # the uninterrupted run
    ref_final = final_loss(step, params)
    params, state, _ = train(step, step.shard(init_params()), None, 0, stop_at)
    meta = {"layout": cfg, "world": world.size, "steps": steps, "reference_losses": ref, "reference_final": ref_final}
    path = checkpoint.save(f"{ckpt}/{stop_at:06d}", step, params, state, iteration=stop_at, meta=meta)
    if world.rank == 0:
        print(f"uninterrupted: {steps} steps on {cfg} x {world.size} ranks, final loss {ref_final:.12g}")
        print(f"checkpoint at step {stop_at}: {path}; stopping", flush=True)


def resume(ckpt: str, world: engine.World) -> None:
    path = checkpoint.latest(ckpt)
    if path is None:
        raise SystemExit(f"no complete checkpoint under {ckpt}: run --phase first")
    manifest = checkpoint.read_manifest(path)
    meta, start = manifest["meta"], manifest["iteration"]
    cfg = layout(world.size, "resume")
    step = make_step(cfg)
    params, state = checkpoint.load(path, step, init_params())
    params, state, losses = train(step, params, state, start, meta["steps"])
    resumed = final_loss(step, params)
    worst = max(abs(a - b) / abs(b) for a, b in zip([*losses, resumed], [*meta["reference_losses"][start:],
                                                                       meta["reference_final"]]))
    if world.rank == 0:
        print(f"resumed from step {start} ({meta['layout']} x {meta['world']} ranks) on {cfg} x {world.size} ranks")
        print(f"final loss: uninterrupted {meta['reference_final']:.12g}, resumed {resumed:.12g}; "
              f"worst relative difference over the resumed steps {worst:.1e}", flush=True)
    if not worst <= 1e-9:
        raise SystemExit(f"rank {world.rank}: resumed run diverged from the uninterrupted one ({worst:.1e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", help="checkpoint root (default: a temp dir; needed across --phase runs)")
    ap.add_argument("--phase", choices=("first", "resume", "both"), default="both")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stop-at", type=int, default=3)
    args = ap.parse_args()
    world = engine.init()
    if args.phase != "both" and not args.ckpt:
        ap.error("--phase first/resume needs --ckpt (the runs share it)")
    ckpt = args.ckpt or _shared_tempdir(world)
    if args.phase in ("first", "both"):
        first(ckpt, args.steps, args.stop_at, world)
    if args.phase in ("resume", "both"):
        resume(ckpt, world)
    if not args.ckpt:
        _barrier(world)
        if world.rank == 0:
            shutil.rmtree(ckpt)


def _barrier(world: engine.World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier()


def _shared_tempdir(world: engine.World) -> str:
    """One temp dir for all ranks (rank 0 makes it and tells the others)."""
    name = tempfile.mkdtemp(prefix="fnpipe-resume-") if world.rank == 0 else None
    if world.size > 1:
        from engine.execution.transport import broadcast_json

        name = broadcast_json(name)
    assert name is not None  # rank 0 made it
    return name


if __name__ == "__main__":
    main()
