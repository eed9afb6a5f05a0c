"""Counts the expensive passes of one `engine.parallelize` on each rank (run under mpirun; see test_one_path).

Prints one line per rank and case: `PASSES rank R CASE {json}` with the calls of ir.trace, stage autodiff
(and how many distinct stages they were for), joint traces (the expensive part of stage autodiff: make_fx
of `outputs, vjp(cotangents)`; and how many distinct graphs they traced), the schedule registry, the
simulator, lowering and program emission (and for which world ranks), made while `parallelize` ran.
"""
from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine  # noqa: E402
import engine.execution.assemble as assemble_mod  # noqa: E402
import ir  # noqa: E402
import ir.autodiff as ir_autodiff  # noqa: E402
import schedules  # noqa: E402
from engine.planning.joints import JOINTS, STITCHED  # noqa: E402


def mlp_loss(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for w in params["layers"]:
        h = torch.tanh(h @ w)
    return ((h - y) ** 2).mean()


class Counter:
    """Wraps module attributes so that every call is counted (and, for some, what it was called on)."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.keys: dict[str, list[Any]] = collections.defaultdict(list)
        self.undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, label: str, key: Callable[..., Any] | None = None) -> None:
        real = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[label] += 1
            if key is not None:
                self.keys[label].append(key(*args, **kwargs))
            return real(*args, **kwargs)

        setattr(owner, name, counted)
        self.undo.append(lambda: setattr(owner, name, real))

    def restore(self) -> None:
        for undo in reversed(self.undo):
            undo()


def counting() -> Counter:
    c = Counter()
    c.wrap(ir, "trace", "trace")
    c.wrap(ir, "stage_autodiff", "stage_autodiff",
           key=lambda g, **kw: (str(g), tuple(kw.get("constant", ())), bool(kw.get("recompute", False))))
    c.wrap(ir_autodiff, "_trace_joint", "trace_joint", key=lambda g, diff_in, diff_out, device: (str(g), tuple(diff_in)))
    c.wrap(schedules, "get", "registry_get")
    c.wrap(schedules, "simulate", "simulate")
    c.wrap(schedules, "lower", "lower")
    c.wrap(assemble_mod, "emit", "emit", key=lambda *a, **kw: kw["world_rank"])
    return c


def main() -> None:
    torch.manual_seed(0)
    params = {"layers": [torch.randn(16, 16, dtype=torch.float64) / 4 for _ in range(3)]}
    x, y = torch.randn(32, 16, dtype=torch.float64), torch.randn(32, 16, dtype=torch.float64)
    graph = ir.trace(mlp_loss, params, x[:8], y[:8])
    cases = {"given cuts": dict(cuts=[len(graph.eqns) // 2]), "split by the planner": {},
             "given cuts again": dict(cuts=[len(graph.eqns) // 2])}  # the process's joints kept: none traced
    for name, options in cases.items():
        if not name.endswith("again"):
            JOINTS.clear()  # each of the first two counts its own joints
            STITCHED.clear()
        c = counting()
        try:
            step = engine.parallelize(mlp_loss, params, x, y, schedule="1f1b", microbatches=4, stages=2, timeout=60,
                                          **options)  # one schedule: what one path means (auto plans eight)
        finally:
            c.restore()
        stages = c.keys["stage_autodiff"]
        record = {**c.calls, "distinct_stage_autodiff": len(set(stages)), "emitted_for": c.keys["emit"],
                  "distinct_trace_joint": len(set(c.keys["trace_joint"])),
                  "num_stages": step.plan.num_stages}
        print(f"PASSES rank {step.world.rank} {name.replace(' ', '_')} {json.dumps(record, sort_keys=True)}",
              flush=True)
        loss, grads = step(step.shard(params), x, y)
        ref_grads, ref_loss = torch.func.grad_and_value(mlp_loss)(params, x, y)
        mine = [(g, r) for g, r in zip(grads["layers"], ref_grads["layers"]) if g is not None]
        assert mine and all(torch.allclose(g, r, rtol=1e-10, atol=0) for g, r in mine)
        assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
        print(f"OK rank {step.world.rank} {name.replace(' ', '_')}", flush=True)


if __name__ == "__main__":
    main()
