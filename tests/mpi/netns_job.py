"""Run by torchrun on two "hosts" (network namespaces): the 4-rank step equals one process, float64.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint ADDR:PORT tests/mpi/netns_job.py

Two layouts: 4 stages (activations cross the hosts) and 2 stages x dp 2 with ZeRO-1 (the dp
reduce-scatter and all-gather cross them). Prints one line per layout and rank, with the interface
gloo was pointed at; exits non-zero on a mismatch.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.utils import _pytree as pytree

import engine
from tests.mpi import models


def main() -> int:
    world = engine.init()
    params, batch = models.init_params(layers=4), models.batch(size=16)
    ref = pytree.tree_leaves(torch.func.grad(models.loss_fn)(params, *batch))
    ok = True
    for cfg in (dict(stages=4, dp=1), dict(stages=2, dp=2, shard_optimizer=True)):
        with engine.parallelize(models.loss_fn, params, *batch, microbatches=2, **cfg) as step:
            local = step.shard(params)
            _, grads = step(local, *batch)
            if step.plan.shard_optimizer:  # the summed grads, this replica's slices, against the reference's
                opt = engine.optim.ShardedOptimizer(step, engine.optim.sgd, lr=0.0)
                grads, ref_now = opt.reduce_scatter(grads), opt.shard(pytree.tree_unflatten(ref, pytree.tree_structure(params)))
                flat = lambda t: pytree.tree_flatten(t, is_leaf=lambda x: x is None)[0]  # noqa: E731
                pairs = [(g, r) for g, r in zip(flat(grads), flat(ref_now)) if g is not None]
            else:
                pairs = [(g, r) for g, r in zip(pytree.tree_flatten(grads, is_leaf=lambda x: x is None)[0], ref)
                         if g is not None]
            err = max(((g - r).norm() / max(r.norm(), 1e-300)).item() for g, r in pairs)
            good = err <= 1e-12 and len(pairs) > 0
            ok &= good
            line = (f"{'OK' if good else 'FAIL'} rank {world.rank} of {world.size} {cfg} iface "
                    f"{os.environ.get('GLOO_SOCKET_IFNAME')} master {os.environ.get('MASTER_ADDR')} "
                    f"max rel err {err:.1e}\n")
            os.write(1, line.encode())  # one write: two ranks of a node share the pipe, lines must not interleave
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
