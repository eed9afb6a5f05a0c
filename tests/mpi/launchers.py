"""The same step under every launcher: torchrun, mpirun or plain python (tests/engine/test_mpi.py).

    torchrun --nproc_per_node 2 tests/mpi/launchers.py      # or: python tests/mpi/launchers.py
Prints one `OK`/`FAIL` line per configuration and rank, with the full-batch loss and the sum of the local
grad leaves' squared norms written exactly (float.hex), so runs under different launchers can be compared.
"""
from __future__ import annotations

import sys

import torch
from torch.utils import _pytree as pytree

import engine
from tests.mpi import models

RTOL = 1e-10  # float64


def configs(world: int) -> list[dict]:
    """A plain and a two-stages-per-rank layout for `world` pipeline ranks."""
    return [dict(schedule="1f1b", stages=world), dict(schedule="zbv", stages=2 * world)]


def check(cfg: dict, world: engine.World) -> bool:
    params, batch = models.init_params(layers=4), models.batch(size=16)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    step = engine.parallelize(models.loss_fn, params, *batch, microbatches=4, timeout=60, **cfg)
    loss, grads = step(step.shard(params), *batch)
    names = step.graph.input_names
    local = [(n, g.cpu(), r) for n, g, r in zip(names, pytree.tree_leaves(grads, is_leaf=lambda x: x is None),
                                                 pytree.tree_leaves(ref)) if g is not None]
    errs = [abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())]
    errs += [((g - r).norm() / r.norm()).item() for _, g, r in local]
    ok = max(errs) <= RTOL
    norms = ",".join(f"{n}={(g * g).sum().item().hex()}" for n, g, _ in local)
    print(f"{'OK' if ok else 'FAIL'} world {world.size} rank {world.rank} {cfg['schedule']} stages {cfg['stages']} "
          f"max rel err {max(errs):.1e} loss {loss.item().hex()} grad sq {norms}\n", end="", flush=True)
    return ok


def main() -> int:
    world = engine.init()
    return 0 if all([check(cfg, world) for cfg in configs(world.size)]) else 1


if __name__ == "__main__":
    sys.exit(main())
