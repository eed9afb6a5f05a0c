"""Run under mpirun: unequal replicas per stage, every schedule, against torch.func.grad (float64).

    mpirun -n 3 python tests/mpi/replicas.py      # stage 0 x 2 + stage 1 x 1
    mpirun -n 4 python tests/mpi/replicas.py      # stage 0 x 2 + stage 1 x 1 + stage 2 x 1, and 1 x 3
Prints one line per configuration (with the order the planner chose) and exits non-zero at a mismatch.
Then `step.evaluate` on a BatchNorm net with the same replicas (1f1b): its logits against the module's in
eval mode, gathered on every rank and, per last-position rank, the rows of the microbatches it ran.
"""
from __future__ import annotations

import faulthandler
import os
import sys

import copy

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

import engine
from tests.mpi import models
from tests.mpi.batchnorm import batch as bn_batch, bn_net

RTOL = 1e-10
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "zbv": 2, "interleaved-1f1b": 2}  # stages per rank


def configs(world: int) -> list[dict]:
    """(schedule, stages, replicas) per world: 3 ranks run (2, 1); 4 ranks run (2, 1, 1), and (1, 3) for 1f1b."""
    counts = {3: [(2, 1)], 4: [(2, 1, 1)]}[world]
    out = [dict(schedule=name, stages=v * len(c), replicas=c) for c in counts for name, v in SCHEDULES.items()]
    for cfg in out:  # interleaved-1f1b runs microbatches in rounds of p: 3 positions need a multiple of 3 (and of 2)
        if cfg["schedule"] == "interleaved-1f1b" and len(cfg["replicas"]) == 3:
            cfg["microbatches"] = 6
    if world == 4:
        out.append(dict(schedule="1f1b", stages=2, replicas=(1, 3), microbatches=6))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(cfg: dict, rank: int) -> str:
    cfg = dict(cfg)
    m = cfg.pop("microbatches", 4)
    params = models.init_params(dtype=torch.float64, layers=4)
    batch = models.batch(size=4 * m)
    ref_loss, ref = torch.func.grad_and_value(models.loss_fn)(params, *batch)[::-1]
    extra = {"stages_per_rank": 2} if cfg["schedule"] == "interleaved-1f1b" else {}
    with engine.parallelize(models.loss_fn, params, *batch, microbatches=m, **cfg, **extra) as step:
        assert step.plan.replicas == cfg["replicas"], step.plan
        loss, grads = step(step.shard(params), *batch)
        order = step.plan.replica_order
    errs = [rel_err(loss.cpu(), ref_loss)]
    for g, r in zip(pytree.tree_leaves(grads, is_leaf=lambda x: x is None), pytree.tree_leaves(ref)):
        if g is not None:
            errs.append(rel_err(g.cpu(), r))
    worst = max(errs)
    status = "OK" if worst <= RTOL else "FAIL"
    return (f"{status} rank {rank} {cfg['schedule']} replicas {cfg['replicas']} {order} order max rel err {worst:.2e} "
            f"({len(errs) - 1} grad leaves here)")


def check_evaluate(replicas: tuple[int, ...], rank: int) -> str:
    """EVAL OK/FAIL line: evaluate with unequal replicas, both gathers, after one training step."""
    m = 4 if all(4 % c == 0 for c in replicas) else 6
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = bn_batch(4 * m)
    want = copy.deepcopy(bn_net()).eval()(x).detach()
    with engine.parallelize(fn, variables, x, y, schedule="1f1b", stages=len(replicas), replicas=replicas,
                            microbatches=m, has_aux=True, min_microbatch_size=1) as step:
        assert step.plan.replicas == replicas, step.plan
        local = step.shard(variables)
        step(local, x, y)  # training first: evaluate then uses the same channels
        errs = [float((step.evaluate(local, x) - want).abs().max())]
        got = step.evaluate(local, x, gather="local")
        if step.position == step.plan.pipeline_depth - 1:
            rows = len(x) // step.plan.microbatches
            errs.append(float((got - torch.cat([want[i * rows:(i + 1) * rows] for i in step.microbatches])).abs().max()))
        elif got is not None:
            errs.append(float("inf"))
    worst = max(errs)
    return f"EVAL {'OK' if worst <= 1e-12 else 'FAIL'} rank {rank} replicas {replicas} max abs err {worst:.1e}"


def main() -> int:
    if os.environ.get("FNPIPE_HANG_DUMP"):
        faulthandler.dump_traceback_later(float(os.environ["FNPIPE_HANG_DUMP"]), exit=True)
    world = engine.init()
    failed = 0
    for cfg in configs(world.size):
        line = check(cfg, world.rank)
        failed += line.startswith("FAIL")
        print(line, flush=True)
    for counts in sorted({c["replicas"] for c in configs(world.size)}):
        line = check_evaluate(counts, world.rank)
        failed += line.startswith("EVAL FAIL")
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
