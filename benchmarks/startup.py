"""Time to first step: how long `engine.parallelize` takes for the 1 B GPT of plan_gpt.py, on CPU ranks.

    mpirun -n 2 --oversubscribe python benchmarks/startup.py [--runs 3] [--schedule 1f1b] [--tree .]

Each rank times `parallelize` (launch, trace, plan, stage programs, emission, fingerprint check) with the
weights on the meta device (nothing of their 2 GB is allocated: what is timed is the engine's own work,
not a copy of weights) and a batch of 16 x 1024 tokens in 8 microbatches. Rank 0 prints one line per
run and the median. `--tree DIR` imports fnpipe from another checkout (e.g. a worktree of an older
commit), so two versions can be timed side by side in one session.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.tree).resolve()))
    import torch

    import engine
    from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

    config = GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=18, head_dim=128)
    params = init_params(config, torch.bfloat16, "meta")
    tokens, targets = example_batch(config, args.batch, "meta")
    fn = make_loss_fn(config)
    times = []
    for run in range(args.runs):
        began = time.perf_counter()
        step = engine.parallelize(fn, params, tokens, targets, schedule=args.schedule,
                                  microbatches=args.microbatches, timeout=600)
        times.append(time.perf_counter() - began)
        if step.world.rank == 0:
            print(f"run {run}: parallelize {times[-1]:.2f} s ({step.plan.num_stages} stages, "
                  f"{len(step.program.instrs)} instructions on rank 0)", flush=True)
        del step
    if engine.init().rank == 0:
        print(f"tree {args.tree}: median {statistics.median(times):.2f} s, min {min(times):.2f} s over "
              f"{args.runs} runs, world {engine.init().size}", flush=True)


if __name__ == "__main__":
    main()
