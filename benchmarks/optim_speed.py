"""Seconds per step of `engine.optim` against `torch.optim` (foreach=True, and fused=True) on the same leaves.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/optim_speed.py            # CPU, N=15 steps
    PYTHONPATH=. python benchmarks/optim_speed.py --device cuda --steps 50

Two trees: a GPT-like one (24 blocks of width 256, a 32k vocabulary: 292 leaves, 27 M params) and one of
3,000 small leaves. Each row steps both optimizers from the same params with the same grads, one step of
each in turn (so load from other processes hits both alike), and prints the median seconds per step, the
ratio engine / torch foreach, and the largest relative difference of the params after the last step.
engine.optim returns new tensors each step, as a pure function must, and the caller drops the old ones;
torch.optim updates in place, so on CPU the allocator's fresh pages are part of engine.optim's time
(`THP_MEM_ALLOC_ENABLE=1`, PyTorch's huge pages for large CPU tensors, takes most of that away).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from engine import optim

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SGD = dict(lr=1e-2, momentum=0.9, weight_decay=1e-4)


def gpt_tree(blocks: int = 24, width: int = 256, vocab: int = 32768, context: int = 512) -> dict:
    def block() -> dict:
        def linear(n_out: int, n_in: int) -> dict:
            return {"w": torch.randn(n_out, n_in), "b": torch.randn(n_out)}
        w = width
        return {"ln1": {"w": torch.randn(w), "b": torch.randn(w)}, "ln2": {"w": torch.randn(w), "b": torch.randn(w)},
                "qkv": linear(3 * w, w), "proj": linear(w, w), "up": linear(4 * w, w), "down": linear(w, 4 * w)}
    return {"wte": torch.randn(vocab, width), "wpe": torch.randn(context, width),
            "blocks": [block() for _ in range(blocks)], "ln_f": {"w": torch.randn(width), "b": torch.randn(width)}}


def small_tree(leaves: int = 3000, size: int = 128) -> list:
    return [torch.randn(size) for _ in range(leaves)]


def clocks(name: str) -> Callable[[], float]:
    return time.perf_counter if name == "wall" else time.process_time


def bench(kind: str, params: Any, steps: int, clock: Callable[[], float], warmup: int = 2) -> dict:
    """Median seconds per step of engine.optim and torch.optim (foreach, fused), stepped in turn."""
    fn, kw, cls = (optim.adamw, ADAMW, torch.optim.AdamW) if kind == "adamw" else (optim.sgd, SGD, torch.optim.SGD)
    leaves = [x for x in pytree.tree_leaves(params) if x is not None]
    grads = [[torch.randn_like(x) for x in leaves] for _ in range(2)]  # two sets, alternated: not a constant grad
    spec = pytree.tree_structure(params)
    grad_trees = [pytree.tree_unflatten(g, spec) for g in grads]
    ours, state = params, None
    refs = {}
    for mode in ("foreach", "fused"):
        copies = [x.clone() for x in leaves]
        refs[mode] = (copies, cls(copies, **kw, **{mode: True}))
    times: dict[str, list[float]] = {"engine": [], "foreach": [], "fused": []}
    for i in range(warmup + steps):
        g = grads[i % 2]
        began = clock()
        ours, state = fn(ours, grad_trees[i % 2], state, **kw)
        times["engine"].append(clock() - began)
        for mode, (copies, opt) in refs.items():
            for x, gx in zip(copies, g):
                x.grad = gx
            began = clock()
            opt.step()
            times[mode].append(clock() - began)
    if torch.cuda.is_available() and leaves[0].is_cuda:
        torch.cuda.synchronize()
    mine = [x for x in pytree.tree_leaves(ours) if x is not None]
    diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(mine, refs["foreach"][0]))
    med = {k: statistics.median(v[warmup:]) for k, v in times.items()}
    return {**med, "diff": diff, "leaves": len(leaves), "numel": sum(x.numel() for x in leaves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per optimizer (median reported)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter; cpu: this process's CPU time (steadier on a shared machine)")
    args = parser.parse_args()
    if args.device.startswith("cuda"):  # CUDA steps are asynchronous: time them to completion
        sync = torch.cuda.synchronize
        base = clocks(args.clock)
        clock: Callable[[], float] = lambda: (sync(), base())[1]  # noqa: E731
    else:
        clock = clocks(args.clock)
    torch.manual_seed(0)
    trees = {"gpt": gpt_tree, "small": small_tree}
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"clock {args.clock}, median of {args.steps} steps")
    print(f"{'optimizer':9} {'tree':6} {'leaves':>6} {'params':>10} {'engine s':>9} {'foreach s':>9} "
          f"{'ratio':>6} {'fused s':>9} {'max rel diff':>12}")
    for name, make in trees.items():
        params = pytree.tree_map(lambda x: x.to(args.device), make())
        for kind in ("adamw", "sgd"):
            r = bench(kind, params, args.steps, clock)
            print(f"{kind:9} {name:6} {r['leaves']:>6} {r['numel']:>10,} {r['engine']:>9.4f} {r['foreach']:>9.4f} "
                  f"{r['engine'] / r['foreach']:>6.2f} {r['fused']:>9.4f} {r['diff']:>12.1e}")


if __name__ == "__main__":
    main()
