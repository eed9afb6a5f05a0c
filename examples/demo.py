"""fnpipe in one run: trace a loss into the IR, check it, plan a pipeline, and train over 2 ranks.

    make demo                                   # = mpirun -n 2 python examples/demo.py (CPU, gloo)
    PYTHONPATH=. python examples/demo.py        # one rank: the same numbers, no pipeline

Prints the IR of a small function with its per-equation costs and the evaluation check, then for a
small GPT: the plan, the schedule's simulated timeline, a measured timeline of one step, the check of
loss and every grad against torch.func.grad, and the losses of a short training run. Writes PNG and
Perfetto timelines to out/ (open the JSON at ui.perfetto.dev).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
import ir  # noqa: E402
import schedules  # noqa: E402
from engine.execution.spans import render_spans, save_perfetto  # noqa: E402
from examples.gpt_model import GPTConfig, init_params, make_loss_fn  # noqa: E402
from examples.train_gpt import PatternLoader  # noqa: E402

OUT = Path(os.environ.get("FNPIPE_OUT", "out"))


def mlp_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = F.gelu(x @ params["w1"] + params["b1"])
    return F.mse_loss(h @ params["w2"], y)


def show_ir() -> None:
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 16, generator=g), "b1": torch.zeros(16), "w2": torch.randn(16, 4, generator=g)}
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    graph = ir.trace(mlp_loss, params, x, y)
    ir.check(graph)
    print("== the IR of mlp_loss (jaxpr-like; params ; batch) ==")
    print(graph)
    print("\n== per-equation costs ==")
    print(ir.format_costs(graph))
    err = (ir.evaluate(graph, params, x, y) - mlp_loss(params, x, y)).abs().item()
    print(f"\nevaluation check: |ir.evaluate - eager| = {err:.1e}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_against_func_grad(step: engine.Step, fn, params, batch) -> None:
    loss, grads = step(step.shard(params), *batch)
    ref_loss, ref = torch.func.grad_and_value(fn)(params, *batch)[::-1]
    errs = [rel_err(g.cpu(), r) for g, r in zip(pytree.tree_leaves(grads), pytree.tree_leaves(ref)) if g is not None]
    print(f"rank {step.world.rank}: loss {loss.item():.6f} vs torch.func.grad {ref_loss.item():.6f}; "
          f"max rel err over this rank's {len(errs)} grad leaves {max(errs):.1e}", flush=True)


def train(step: engine.Step, params, loader: PatternLoader, steps: int) -> None:
    local = step.shard(params)
    state = None
    for k in range(steps):
        loss, grads = step(local, *loader.batch_at(k))
        local, state = engine.optim.adamw(local, grads, state, lr=3e-3, weight_decay=0.0)
        if step.world.rank == 0 and (k % 5 == 0 or k == steps - 1):
            print(f"step {k:3d}  loss {loss.item():.4f}", flush=True)


def main() -> None:
    world = engine.init()
    if world.rank == 0:
        show_ir()
    config = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=4, head_dim=16)
    params, fn = init_params(config, torch.float64), make_loss_fn(config)
    loader = PatternLoader(config, 16, pattern_vocab=64)
    step = engine.parallelize(fn, params, *loader.batch_at(0), schedule="1f1b", microbatches=4)
    if world.rank == 0:
        print(f"\n== plan for a {sum(p.numel() for p in pytree.tree_leaves(params)):,}-parameter GPT on "
              f"{world.size} rank(s) ==")
        print(step.plan)
        sim = schedules.simulate(step.table)
        print("\n== the schedule (lowered, unit costs) ==")
        print(schedules.render_ascii(sim))
    sys.stdout.flush()  # rank 0's sections before any rank's program, and the programs in rank order
    for r in range(world.size):
        if r == world.rank:
            print(f"\n== rank {r}'s program (first lines) ==\n" + "\n".join(str(step.program).splitlines()[:8]),
                  flush=True)
        if world.size > 1:
            torch.distributed.barrier()
    check_against_func_grad(step, fn, params, loader.batch_at(0))
    _, _, spans = step.traced(step.shard(params), *loader.batch_at(0))
    spans = step.all_spans(spans)
    if world.rank == 0:
        OUT.mkdir(exist_ok=True)
        print("\n== measured timeline of one step ==")
        print(render_spans(spans))
        save_perfetto(spans, OUT / "demo_trace.json")
        engine.report.save_timeline_png(spans, OUT / "demo_run.png", title="measured")
        schedules.save_png(schedules.simulate(step.table), OUT / "demo_schedule.png", title="simulated")
        print(f"wrote {OUT}/demo_trace.json (Perfetto), {OUT}/demo_run.png and {OUT}/demo_schedule.png "
              "(the same colours and labels)\n\n== training ==")
    train(step, params, loader, 30)


if __name__ == "__main__":
    main()
