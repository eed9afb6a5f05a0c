"""Train the GPT of examples/gpt_model.py with fnpipe: synthetic data, AdamW, a log the loss visibly falls in.

    PYTHONPATH=. python examples/train_gpt.py                                   # one process, no pipeline
    PYTHONPATH=. torchrun --nproc_per_node 2 --master-port 29512 examples/train_gpt.py --schedule zbv
    PYTHONPATH=. mpirun -n 2 python examples/train_gpt.py --schedule 1f1b --microbatches 8
    # GPUs: NCCL and bf16; --size small (default with CUDA) or base (the benchmark's 16 x 2048 GPT);
    # --compiler auto (the default) compiles each stage program with inductor on CUDA (a minute the first
    # time, seconds from the compile cache after), fx elsewhere; --compiler fx runs eager's kernels

The data is a learnable pattern: a fixed random successor for each of the first `--pattern-vocab` token
ids, so each sequence is a walk `t, succ[t], succ[succ[t]], ...` from a random start. Cross-entropy starts
at ln(vocab), drops to ln(pattern vocab) once unused ids are ruled out, and falls toward zero as the model
learns the successor table. Every rank builds the same batch from (seed, step): fnpipe
takes the full batch on every rank and cuts it into microbatches itself.

The optimizer is torch.optim.AdamW over this rank's leaves (the non-None leaves of `step.shard(params)`),
fed the grads `step` returns. A tied embedding is held by the first and last rank alike; fnpipe sums its
grad over both, so both copies take the same update and stay equal.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from examples.gpt_model import GPTConfig, init_params, make_loss_fn  # noqa: E402

SIZES = {
    "tiny": GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layers=4, head_dim=32),
    "small": GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=12, head_dim=64),
    "base": GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=16, head_dim=128),
}


class PatternLoader:
    """Batches of walks through a fixed random successor table; batch k is the same on every rank."""

    def __init__(self, config: GPTConfig, batch_size: int, *, seed: int = 0, pattern_vocab: int = 512) -> None:
        self.vocab = min(config.vocab_size, pattern_vocab)  # walks stay in the first `vocab` token ids
        self.seq, self.batch, self.seed = config.seq_len, batch_size, seed
        self.succ = torch.randperm(self.vocab, generator=torch.Generator().manual_seed(seed))

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        walk = [torch.randint(0, self.vocab, (self.batch,), generator=gen)]
        for _ in range(self.seq):
            walk.append(self.succ[walk[-1]])
        seq = torch.stack(walk, dim=1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        step = 0
        while True:
            yield self.batch_at(step)
            step += 1


def lr_at(step: int, *, lr: float, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def leaves(tree: Any) -> list[Any]:
    """Every leaf, None included (the trees `step.shard` and `step` return hold None off this rank)."""
    return pytree.tree_leaves(tree, is_leaf=lambda x: x is None)


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small" if cuda else "tiny")
    ap.add_argument("--tiny", action="store_true", help="same as --size tiny (the CPU default)")
    ap.add_argument("--steps", type=int, default=None, help="default 150 (tiny) or 300")
    ap.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4 per microbatch)")
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default: one per rank, two for zbv)")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default 1)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3 tiny, 3e-4 else)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16" if cuda else "float32")
    ap.add_argument("--compiler", choices=("auto", "fx", "inductor"), default="auto",
                    help="stage programs as generated fx code, or compiled by torch.compile in parallelize; "
                    "auto: inductor on CUDA, fx on CPU")
    ap.add_argument("--pattern-vocab", type=int, default=512, help="token ids the synthetic walks use")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.tiny:
        args.size = "tiny"
    tiny = args.size == "tiny"
    args.steps = args.steps or (150 if tiny else 300)
    args.lr = args.lr or (3e-3 if tiny else 3e-4)
    args.batch = args.batch or 4 * args.microbatches
    return args


def main() -> None:
    args = parse_args()
    config, dtype = SIZES[args.size], getattr(torch, args.dtype)
    world = engine.init()
    say = print if world.rank == 0 else (lambda *a, **k: None)
    loader = PatternLoader(config, args.batch, seed=args.seed, pattern_vocab=args.pattern_vocab)
    tokens, targets = loader.batch_at(0)
    params = init_params(config, dtype, "cpu", seed=args.seed)  # the same tree on every rank
    step = engine.parallelize(make_loss_fn(config), params, tokens, targets, schedule=args.schedule,
                              microbatches=args.microbatches, stages=args.stages, dp=args.dp,
                              compiler=args.compiler)
    params = step.shard(params)
    mine = [x for x in leaves(params) if x is not None]
    opt = torch.optim.AdamW(mine, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    say(f"GPT {args.size}: {config.num_params() / 1e6:.1f} M params, {config.n_layers} blocks, d={config.d_model}, "
        f"vocab {config.vocab_size}, seq {config.seq_len}, {args.dtype}; {world.size} rank(s) on {world.device.type}; "
        f"batch {args.batch}, {args.steps} steps; ln(vocab) = {math.log(config.vocab_size):.3f}\n{step.plan}",
        flush=True)
    say(f"rank {world.rank} holds {len(mine)} leaves, {sum(x.numel() for x in mine) / 1e6:.1f} M params", flush=True)
    tokens_per_step, t_start, first = args.batch * config.seq_len, time.perf_counter(), None
    window_t, window_n = time.perf_counter(), 0
    for k, (x, y) in zip(range(args.steps), loader):
        loss, grads = step(params, x, y)
        for p, g in zip(leaves(params), leaves(grads)):
            if p is not None:
                p.grad = g
        for group in opt.param_groups:
            group["lr"] = lr_at(k, lr=args.lr, warmup=args.warmup, steps=args.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        del grads
        window_n += 1
        loss_value = float(loss)
        first = loss_value if first is None else first
        if k % args.log_every == 0 or k == args.steps - 1:
            now = time.perf_counter()
            rate = window_n * tokens_per_step / (now - window_t)
            eta = (now - t_start) / (k + 1) * (args.steps - k - 1)
            say(f"step {k + 1:5d}/{args.steps} ({100 * (k + 1) / args.steps:3.0f}%)  loss {loss_value:.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {rate:,.0f} tokens/s  eta {eta:.0f} s", flush=True)
            window_t, window_n = now, 0
    say(f"done in {time.perf_counter() - t_start:.1f} s: loss {first:.4f} -> {loss_value:.4f}", flush=True)


if __name__ == "__main__":
    main()
