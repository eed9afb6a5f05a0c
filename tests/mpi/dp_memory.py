"""A data-parallel step's memory on each rank against the planner and the replay (run under mpirun -n 2).

Prints one line per rank: `DPMEM rank R {json}` with the CPU allocator's peak over a step (plus the params and
batch held before it), the program replay's peak (`step.memory()`), the planner's rank peak without Adam
state and margin, and the same planner peak without the all-reduce term (what it predicted before).
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402
from engine.planning.memory import MemoryModel, rank_peaks  # noqa: E402
from engine.planning.stage_costs import exact, splits_bw  # noqa: E402
from engine.planning.op_costs import CostModel  # noqa: E402
from engine.planning.devices import get_device, get_link  # noqa: E402
from tests.cpu_allocator import allocator_peak  # noqa: E402

D, H, L, B = 64, 1024, 4, 16  # weights outweigh the activations: the all-reduce is the peak


def model() -> tuple:
    torch.manual_seed(0)
    params = {"layers": [{"w1": torch.randn(D, H) / D**0.5, "w2": torch.randn(H, D) / H**0.5} for _ in range(L)]}

    def loss_fn(p, x, y):  # type: ignore[no-untyped-def]
        for layer in p["layers"]:
            x = x + torch.tanh(x @ layer["w1"]) @ layer["w2"]
        return ((x - y) ** 2).mean()

    return loss_fn, params, torch.randn(B, D), torch.randn(B, D)


def main() -> None:
    fn, params, x, y = model()
    bare = MemoryModel(optimizer_factor=0.0, margin=0.0)
    step = engine.parallelize(fn, params, x, y, schedule="1f1b", microbatches=2, dp=2, compiler="fx")
    plan = engine.plan(fn, params, x, y, world_size=2, dp=2, schedule="1f1b", microbatches=2, memory_model=bare,
                       cuts=step.plan.cuts)
    rank = step.world.rank
    local = step.shard(params)
    step(local, x, y)  # warm up outside the window
    step.executor.grads = {}
    gc.collect()
    measured = allocator_peak(lambda: step(local, x, y))
    fp = step.memory()[rank]
    graph = step.planned.graph
    cost = exact(graph, plan.cuts, CostModel(get_device("cpu"), get_link(None, get_device("cpu"))))
    table = plan.table()
    before = rank_peaks(table, [s.memory(bare, split_bw=splits_bw(table)) for s in cost], bare)
    print("DPMEM rank", rank, json.dumps({"measured": fp.static + measured, "replay": fp.peak,
                                          "planner": plan.rank_memory[0], "planner_before": before[0]}), flush=True)
    step.close()


if __name__ == "__main__":
    main()
