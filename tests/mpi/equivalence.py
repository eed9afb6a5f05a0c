"""Run under mpirun: every built-in schedule, with and without data parallel, against torch.func.grad.

    mpirun -n 2 python tests/mpi/equivalence.py      # or -n 4
Prints one line per configuration and exits non-zero at the first mismatch.
"""
from __future__ import annotations

import faulthandler
import os
import sys

import torch
from torch.utils import _pytree as pytree

import engine
from tests.mpi import models

RTOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def configs(world: int) -> list[dict]:
    """(schedule, stages, dp, stages_per_rank) that fit `world` ranks."""
    out = []
    for dp in (1, 2):
        if world % dp:
            continue
        p = world // dp
        out += [dict(schedule="gpipe", stages=p, dp=dp), dict(schedule="1f1b", stages=p, dp=dp),
                dict(schedule="zb-h1", stages=p, dp=dp), dict(schedule="zbv", stages=2 * p, dp=dp),
                dict(schedule="interleaved-1f1b", stages=2 * p, dp=dp, stages_per_rank=2),
                dict(schedule="looped-bfs", stages=2 * p, dp=dp, stages_per_rank=2),
                dict(schedule="interleaved-zb", stages=2 * p, dp=dp, stages_per_rank=2),
                dict(schedule="dualpipev", stages=2 * p, dp=dp, microbatches=max(4, 2 * p))]  # DeepSeek's: m >= 2p
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(cfg: dict, dtype: torch.dtype, rank: int) -> str:
    params = models.init_params(dtype=dtype, layers=4)
    batch = models.batch(size=16)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    # fx: the runtime over NCCL is under test (compiler="auto" would compile every case with inductor on GPU)
    step = engine.parallelize(models.loss_fn, params, *batch, **{"microbatches": 4, "compiler": "fx", **cfg})
    loss, grads = step(step.shard(params), *batch)
    errs = [rel_err(loss.cpu(), ref_loss)]
    names = step.graph.input_names
    for name, g, r in zip(names, pytree.tree_leaves(grads, is_leaf=lambda x: x is None), pytree.tree_leaves(ref)):
        if g is not None:
            errs.append(rel_err(g.cpu(), r))
    worst = max(errs)
    status = "OK" if worst <= RTOL[dtype] else "FAIL"
    return f"{status} rank {rank} {cfg} {str(dtype)[6:]} max rel err {worst:.2e} ({len(errs) - 1} grad leaves here)"


def main() -> int:
    if os.environ.get("FNPIPE_HANG_DUMP"):
        faulthandler.dump_traceback_later(float(os.environ["FNPIPE_HANG_DUMP"]), exit=True)
    world = engine.init()
    torch.manual_seed(0)
    failed = 0
    for cfg in configs(world.size):
        for dtype in (torch.float64, torch.float32):
            line = check(cfg, dtype, world.rank)
            failed += line.startswith("FAIL")
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
