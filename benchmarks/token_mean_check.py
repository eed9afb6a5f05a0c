"""The counted-target mean (cross-entropy with ignore_index) on the device: fnpipe's step against one process.

    PYTHONPATH=. python benchmarks/token_mean_check.py            # one GPU (or the CPU), float64
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/token_mean_check.py

A small next-token model, padding labelled -100 unevenly across the microbatches, the batch on the device (so
the per-microbatch weights are made there without a sync: engine/execution/loss_weights.py). Prints the loss
and the worst relative grad error against `torch.func.grad_and_value` on the whole batch, per schedule.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402

V, D = 64, 32


def loss_fn(p: dict, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    h = p["emb"][tokens]
    for w in p["w"]:
        h = h + torch.tanh(h @ w)
    logits = h @ p["head"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))


def main() -> None:
    world = engine.init()
    device = world.device
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(V, D, generator=g, dtype=torch.float64),
              "w": [torch.randn(D, D, generator=g, dtype=torch.float64) / D ** 0.5 for _ in range(4)],
              "head": torch.randn(D, V, generator=g, dtype=torch.float64)}
    params = pytree.tree_map(lambda t: t.to(device), params)
    tokens = torch.randint(0, V, (16, 24), generator=g)
    labels = tokens.clone()
    for row, start in {0: 3, 1: 10, 5: 2, 9: 17, 12: 6}.items():
        labels[row, start:] = -100
    tokens, labels = tokens.to(device), labels.to(device)
    grads_ref, loss_ref = torch.func.grad_and_value(loss_fn)(params, tokens, labels)
    for schedule in ("1f1b", "zbv", "gpipe"):
        with engine.parallelize(loss_fn, params, tokens, labels, schedule=schedule, microbatches=4) as step:
            local = step.shard(params)
            loss, grads = step(local, tokens, labels)
        errs = [float((a - b).abs().max() / b.abs().max()) for a, b in
                zip(pytree.tree_leaves(grads), pytree.tree_leaves(grads_ref)) if a is not None]
        print(f"rank {world.rank} {schedule} on {device}: loss {float(loss):.12f} one process {float(loss_ref):.12f}, "
              f"worst grad rel err {max(errs):.1e} over {len(errs)} leaves", flush=True)


if __name__ == "__main__":
    main()
