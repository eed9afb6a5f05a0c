"""Run under mpirun: engine.optim.clip_grad_norm over stages and dp replicas equals one-process torch.

    mpirun -n 2 python tests/mpi/clip_grad_norm.py      # 2 stages; -n 4: 2 stages x dp 2 and 4 stages
Prints one line per configuration and rank; exits non-zero on a mismatch.
"""
from __future__ import annotations

import sys

import torch
from torch.utils import _pytree as pytree

import engine
from engine import optim
from tests.mpi import models

MAX_NORM = 0.1


def reference(params: dict, batch: tuple) -> tuple[float, list[torch.Tensor]]:
    grads = [g.clone() for g in pytree.tree_leaves(torch.func.grad(models.loss_fn)(params, *batch))]
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g
    return torch.nn.utils.clip_grad_norm_(ps, MAX_NORM).item(), [p.grad for p in ps]


def check(cfg: dict, rank: int) -> bool:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    ref_norm, ref = reference(params, batch)
    step = engine.parallelize(models.loss_fn, params, *batch, microbatches=2, **cfg)
    _, grads = step(step.shard(params), *batch)
    clipped, norm = optim.clip_grad_norm(grads, MAX_NORM, step=step)
    errs = [abs(norm.item() - ref_norm) / ref_norm]
    errs += [((g.cpu() - r).norm() / r.norm()).item()
             for g, r in zip(pytree.tree_leaves(clipped), ref) if g is not None]
    ok = max(errs) <= 1e-12
    print(f"{'OK' if ok else 'FAIL'} rank {rank} {cfg} norm {norm.item():.15g} ref {ref_norm:.15g} "
          f"max rel err {max(errs):.1e} over {len(errs) - 1} local leaves", flush=True)
    return ok


def main() -> int:
    world = engine.init()
    cfgs = [dict(stages=world.size, dp=1)]
    if world.size % 2 == 0 and world.size > 2:
        cfgs.append(dict(stages=world.size // 2, dp=2))
    return 0 if all([check(cfg, world.rank) for cfg in cfgs]) else 1


if __name__ == "__main__":
    sys.exit(main())
