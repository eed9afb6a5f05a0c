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
    """(schedule, stages, dp, stages_per_rank) that fit `world` ranks; FNPIPE_EQ_DP (say "2") and
    FNPIPE_EQ_SCHEDULES (say "dualpipev,zbv") keep some of them (default: all)."""
    out = []
    dps = [int(d) for d in os.environ.get("FNPIPE_EQ_DP", "1,2").split(",")]
    for dp in dps:
        if world % dp:
            continue
        p = world // dp
        out += [dict(schedule="gpipe", stages=p, dp=dp), dict(schedule="1f1b", stages=p, dp=dp),
                dict(schedule="zb-h1", stages=p, dp=dp), dict(schedule="zbv", stages=2 * p, dp=dp),
                dict(schedule="interleaved-1f1b", stages=2 * p, dp=dp, stages_per_rank=2),
                dict(schedule="looped-bfs", stages=2 * p, dp=dp, stages_per_rank=2),
                dict(schedule="interleaved-zb", stages=2 * p, dp=dp, stages_per_rank=2),
                dict(schedule="dualpipev", stages=2 * p, dp=dp, microbatches=max(4, 2 * p))]  # DeepSeek's: m >= 2p
    kept = os.environ.get("FNPIPE_EQ_SCHEDULES")
    return [c for c in out if kept is None or c["schedule"] in kept.split(",")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(cfg: dict, dtype: torch.dtype, rank: int) -> str:
    """One configuration: FNPIPE_EQ_STEPS steps (default 1), each against torch.func.grad and leaving the
    parameters it was given as they were. Past the first, each step gets another batch and the last one new
    parameter tensors (a replayed CUDA graph, FNPIPE_CUDA_GRAPHS=1, must copy them into its clones);
    FNPIPE_EQ_COMPILER picks the compiler (default fx)."""
    steps = int(os.environ.get("FNPIPE_EQ_STEPS", "1"))
    params = models.init_params(dtype=dtype, layers=4)
    batch = models.batch(size=16)
    # fx: the runtime over NCCL is under test (compiler="auto" would compile every case with inductor on GPU)
    compiler = os.environ.get("FNPIPE_EQ_COMPILER", "fx")
    step = engine.parallelize(models.loss_fn, params, *batch, **{"microbatches": 4, "compiler": compiler, **cfg})
    local = step.shard(params)
    worst, leaves = 0.0, 0
    for k in range(steps):
        if k:
            batch = models.batch(size=16, seed=1 + k)
        if k and k == steps - 1:
            params = pytree.tree_map(lambda p: p * 1.01, params)
            local = step.shard(params)
        ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
        given = [t for t in pytree.tree_leaves(local) if t is not None]
        before = [t.clone() for t in given]
        loss, grads = step(local, *batch)
        if not all(torch.equal(t, b) for t, b in zip(given, before)):
            return f"FAIL rank {rank} {cfg} {str(dtype)[6:]}: step {k + 1} wrote into the parameters it was given"
        errs = [rel_err(loss.cpu(), ref_loss)]
        names = step.graph.input_names
        for name, g, r in zip(names, pytree.tree_leaves(grads, is_leaf=lambda x: x is None), pytree.tree_leaves(ref)):
            if g is not None:
                errs.append(rel_err(g.cpu(), r))
        worst, leaves = max(worst, *errs), len(errs) - 1
    status = "OK" if worst <= RTOL[dtype] else "FAIL"
    more = f", {steps} steps" if steps > 1 else ""
    return f"{status} rank {rank} {cfg} {str(dtype)[6:]} max rel err {worst:.2e} ({leaves} grad leaves here{more})"


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
