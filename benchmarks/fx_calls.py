"""What binding the op calls buys an fx program (`ir.compile.bound_ops`): one stage's forward and backward
programs run as fx generated them (`ir.to_fx`: `torch.ops.aten.mm.default(...)` a call) and bound
(`ir.compile_graph`), beside eager autograd on the same microbatch, in alternating rounds.

    PYTHONPATH=. python benchmarks/fx_calls.py [--family llama] [--layers 8] [--rounds 30] [--device cuda]

The benchmark's model (`--layers` blocks, bf16 on CUDA, float32 on CPU) as one stage at fx's level (no
recomputation), one microbatch of 4: each round times, in turn, one eager forward + backward
(`loss.backward()`), the forward and fused backward programs of `ir.to_fx`, and those of `ir.compile_graph`,
each from a synced device to a synced device. A shared host moves between paces (`host_pace.py`): the rounds'
ratios set each against the eager step of its own round. Prints each variant's median milliseconds and the
median of the rounds' ratios.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ir  # noqa: E402
from benchmarks.families import family, lm_loss  # noqa: E402
from engine.planning.artifacts import autodiff  # noqa: E402
from engine.planning.calibration import Programs  # noqa: E402

ROWS = 4


def programs(fam: Any, params: Any, tokens: torch.Tensor, targets: torch.Tensor, dev: torch.device,
             compile_program: Callable[..., Any]) -> Callable[[], None]:
    """One microbatch's forward and fused backward of the whole model as one stage, compiled by `compile_program`."""
    g = ir.trace(fam.loss_fn(), params, tokens, targets)
    stage = ir.split(g, [])[0]
    ad = autodiff(stage, False, device=str(dev))
    param_grads = {s: i for i, s in enumerate(ad.grad_slots[: g.num_params]) if s is not None}
    acc = tuple(k for k, slot in enumerate(ad.backward.out_slots) if slot in param_grads)
    flat = pytree.tree_leaves((params, tokens, targets))
    ran = Programs(ad, dev, flat, acc, param_grads, compile_program)
    return lambda: ran.once(False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="llama")
    ap.add_argument("--size", default="base")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    fam = family(a.family, a.size).with_layers(a.layers)
    params = fam.params(dtype, dev, 0)
    tokens, targets = (t.to(dev) for t in fam.batch(ROWS, 0))
    model = fam.module(params, dev, dtype)

    def eager() -> None:
        lm_loss(model(tokens), targets).backward()

    variants = {"eager autograd": eager,
                "fx, op overloads (ir.to_fx)": programs(fam, params, tokens, targets, dev,
                                                        lambda g, acc: ir.to_fx(g, acc)),
                "fx, bound calls (ir.compile_graph)": programs(fam, params, tokens, targets, dev, ir.compile_graph)}

    def timed(run: Callable[[], None]) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        run()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    for run in variants.values():  # compile, allocate, warm
        for _ in range(3):
            timed(run)
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for k in range(a.rounds):  # each round starts with the next variant: none always runs after the same one
        for name in names[k % len(names):] + names[:k % len(names)]:
            times[name].append(timed(variants[name]))
    print(f"{fam.describe()}, {a.layers} blocks, microbatch {ROWS}, {dtype}, {a.device}, {a.rounds} rounds")
    print(f"{'variant':36} {'median ms':>10} {'min ms':>8} {'x eager (rounds median)':>24}")
    for name, t in times.items():
        ratios = [x / e for x, e in zip(t, times["eager autograd"])]
        print(f"{name:36} {statistics.median(t) * 1e3:10.2f} {min(t) * 1e3:8.2f} {statistics.median(ratios):24.3f}")
    old, new = times["fx, op overloads (ir.to_fx)"], times["fx, bound calls (ir.compile_graph)"]
    print(f"bound / overloads, median of the rounds' ratios: {statistics.median(n / o for n, o in zip(new, old)):.3f}",
          flush=True)


if __name__ == "__main__":
    main()
