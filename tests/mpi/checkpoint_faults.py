"""A damaged checkpoint under mpirun (tests/engine/test_checkpoint.py): save on 2 stages, load it back
bit-identically, then flip one bit of rank 1's shard; every rank's load must raise CheckpointError.

    mpirun -n 2 python tests/mpi/checkpoint_faults.py DIR

Prints `rank R clean load identical` and then `rank R CheckpointError: <message>` (or `rank R loaded the
damaged checkpoint`, which the test fails on).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

import engine
from engine import checkpoint
from tests.mpi import models


def bits_equal(a, b) -> bool:
    pairs = zip(pytree.tree_leaves(a, is_leaf=lambda x: x is None), pytree.tree_leaves(b, is_leaf=lambda x: x is None))
    return all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype and torch.equal(
        x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))) for x, y in pairs)


def main() -> int:
    path = Path(sys.argv[1]) / "000001"
    params, batch = models.init_params(layers=4), models.batch(size=8)
    step = engine.parallelize(models.loss_fn, params, *batch, schedule="1f1b", stages=2, microbatches=2, timeout=60)
    rank, mine = step.world.rank, step.shard(params)
    checkpoint.save(path, step, mine, iteration=1)
    loaded, _ = checkpoint.load(path, step, mine)
    print(f"rank {rank} clean load {'identical' if bits_equal(loaded, mine) else 'DIFFERENT'}", flush=True)
    if rank == 0:
        data = bytearray((path / "rank1.pt").read_bytes())
        data[len(data) // 2] ^= 0x10
        (path / "rank1.pt").write_bytes(bytes(data))
    step.transport.all_gather_json(None)  # every rank loads after the flip
    try:
        checkpoint.load(path, step, mine)
        print(f"rank {rank} loaded the damaged checkpoint", flush=True)
    except checkpoint.CheckpointError as exc:
        print(f"rank {rank} CheckpointError: {exc}", flush=True)
    step.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
