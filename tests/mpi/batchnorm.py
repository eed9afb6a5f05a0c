"""Under mpirun: BatchNorm in train mode (loss, grads and running statistics) and evaluation on the same plan.

Run by tests/engine/test_batchnorm.py as `mpirun -n 2 python tests/mpi/batchnorm.py`; prints `OK ...`
per check and rank, raises (and so aborts the job) on a mismatch.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
from engine.testing import assert_parallel_equivalent
from engine.training.module import updated


def bn_net(width: int = 4, classes: int = 5) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width, momentum=None), nn.ReLU(),
        nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)).double()
    for m in net.modules():  # running statistics away from their initial values, so their updates are seen
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
            m.num_batches_tracked += 3
    return net


def batch(n: int = 16, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64) * 3 + 2, torch.randint(0, classes, (n,), generator=g)


def main() -> None:
    fn, variables = engine.functionalize(bn_net().train(), loss=F.cross_entropy)
    x, y = batch()
    rank = engine.init().rank
    for schedule in ("gpipe", "1f1b", "zb-h1", "zbv", "interleaved-1f1b"):
        for dp in (1, 2):
            stages = 2 if dp == 1 else 1
            if schedule in ("zbv", "interleaved-1f1b"):
                stages *= 2
            eq = assert_parallel_equivalent(fn, variables, x, y, schedule=schedule, dp=dp, stages=stages,
                                            microbatches=2)
            print(f"OK rank {rank} bn {schedule} dp {dp} leaves {eq.leaves} max rel err {eq.max_rel_error:.2e}",
                  flush=True)
    net = bn_net()
    want = copy.deepcopy(net).eval()(x).detach()
    for dp in (1, 2):
        step = engine.parallelize(fn, variables, x, y, microbatches=2, dp=dp, has_aux=True, min_microbatch_size=1)
        local = step.shard(variables)
        (_, state), _ = step(local, x, y)
        logits = step.evaluate(local, x)  # the running statistics given in: those the module holds
        err = float((logits - want).abs().max())
        if err > 1e-12:
            raise AssertionError(f"rank {rank} evaluate dp {dp}: max abs err {err}")
        after = step.evaluate(updated(local, state), x, gather="local")
        if (after is not None) != (step.position == step.plan.pipeline_depth - 1):
            raise AssertionError(f"rank {rank}: gather='local' gave {type(after)}")
        print(f"OK rank {rank} eval dp {dp} max abs err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
