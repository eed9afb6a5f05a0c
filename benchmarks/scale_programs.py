"""Static programs at scale: `schedules.simulate` at p = 128, m = 512 (target <= 10 s), and every rank's
program of a 1,024-rank job (pp 16 x dp 64) emitted, fingerprinted and checked offline (target <= 30 s).

    PYTHONPATH=. python benchmarks/scale_programs.py

The programs come from one plan of a small MLP (16 stages, 64 microbatches, dp 64) made for 1,024
ranks on one process: `assemble` for every world rank, a fingerprint of each program's JSON, and
the interface check `Step.verify` runs (every send met by its receive, every group's sums alike).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import engine
import schedules
from engine.execution.assemble import assemble, disagreements, interface
from engine.planning.artifacts import Planned  # noqa: F401 -- the type search returns
from engine.planning.plan import fingerprint
from engine.planning.search import search


def simulate(p: int = 128, m: int = 512) -> None:
    for name in ("1f1b", "zb-h1"):
        table = schedules.get(name)(p, m)
        began = time.perf_counter()
        schedules.simulate(table)
        unlowered = time.perf_counter() - began
        lowered = schedules.lower(table)
        began = time.perf_counter()
        schedules.simulate(lowered)
        print(f"simulate {name} p={p} m={m}: {unlowered:.2f} s unlowered, {time.perf_counter() - began:.2f} s lowered "
              f"({sum(len(r) for r in lowered.rows)} actions)", flush=True)


def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for w in params["layers"]:
        x = torch.tanh(x @ w)
    return F.mse_loss(x, y)


def programs(pp: int = 16, dp: int = 64, m: int = 64) -> None:
    params = {"layers": [torch.randn(16, 16) for _ in range(pp * 2)]}
    x = torch.randn(dp * m, 16)
    began = time.perf_counter()
    planned = search(loss_fn, params, x, x, world_size=pp * dp, stages=pp, dp=dp, microbatches=m)
    planning = time.perf_counter() - began
    began = time.perf_counter()
    progs = [assemble(planned, r) for r in range(pp * dp)]
    emitted = time.perf_counter() - began
    prints = [fingerprint(p.to_json()) for p in progs]
    faces = [interface(p, pp * dp) for p in progs]
    odd = disagreements(faces)
    total = time.perf_counter() - began
    print(f"programs pp {pp} x dp {dp} = {pp * dp} ranks, {m} microbatches: plan {planning:.1f} s; emit "
          f"{emitted:.1f} s, + fingerprint + check {total:.1f} s; {sum(len(p.instrs) for p in progs)} instructions, "
          f"{len(set(prints))} distinct programs, {len(odd)} disagreements", flush=True)
    assert not odd, odd[:3]


if __name__ == "__main__":
    simulate()
    programs()
