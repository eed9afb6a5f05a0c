"""Show that dualpipev's pairs overlap on GPUs: NCCL transfers of one microbatch run beside the other's compute.

    # 2 GPUs (4 with --nproc_per_node 4): writes $OUT/dualpipev_rank<r>.json (torch.profiler, chrome format) and
    # $OUT/dualpipev_spans.json (fnpipe's instruction spans, ui.perfetto.dev), prints the overlap per rank
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/dualpipev_trace.py
    # CPU (gloo): the same files, no kernel overlap to measure (CPU ops are timed on one thread)
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/dualpipev_trace.py --tiny

dualpipev's table pairs, on each rank, a forward of one microbatch with the (fused) backward of another on the
V's other leg (`schedules.overlapped_pairs`). fnpipe's runtime posts sends and receives asynchronously and waits
for a received buffer only when a compute reads it, so a pair's transfers run on NCCL's stream while its partner
computes. Measured here from the kernel trace of one step: of the time NCCL send/recv kernels run on a rank, the
share during which a compute kernel runs on another stream of that GPU ("overlap"). It passes (exit 0) when the
overlap is at least --min-overlap (0.5) on every rank; the trace files show where.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import engine
import schedules
from engine.execution.spans import save_perfetto
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

BASE = GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=16, head_dim=128, tied=False)
TINY = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=4, head_dim=16, tied=False)


def intervals(events: list[dict[str, Any]], nccl: bool) -> list[tuple[float, float, Any]]:
    """(start, end, stream) in microseconds of the GPU kernels that are (not) NCCL's."""
    return [(e["ts"], e["ts"] + e.get("dur", 0), e.get("tid")) for e in events
            if e.get("cat") == "kernel" and ("nccl" in e.get("name", "").lower()) == nccl]


def overlap(comm: list[tuple[float, float, Any]], compute: list[tuple[float, float, Any]]) -> tuple[float, float]:
    """(NCCL kernel time, of which with a compute kernel running on another stream), in microseconds."""
    merged: list[list[float]] = []
    for start, end, _ in sorted(compute):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = hidden = 0.0
    for start, end, stream in comm:
        total += end - start
        hidden += sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)
    return total, hidden


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--min-overlap", type=float, default=0.5)
    args = ap.parse_args()
    world = engine.init()
    config = TINY if args.tiny or world.device.type == "cpu" else BASE
    dtype = torch.float32 if config is TINY else torch.bfloat16
    params = init_params(config, dtype, world.device, seed=0)
    tokens, targets = example_batch(config, 4 * args.microbatches, seed=1)
    step = engine.parallelize(make_loss_fn(config), params, tokens, targets, schedule="dualpipev",
                              microbatches=args.microbatches)
    local, x, y = step.shard(params), tokens.to(world.device), targets.to(world.device)
    pairs = schedules.overlapped_pairs(step.plan.table())
    for _ in range(3):
        step(local, x, y)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    cuda = world.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step(local, x, y)
        if cuda:
            torch.cuda.synchronize()
    path = out / f"dualpipev_rank{world.rank}.json"
    prof.export_chrome_trace(str(path))
    _, _, spans = step.traced(local, x, y)
    every = step.all_spans(spans)
    if world.rank == 0:
        save_perfetto(every, out / "dualpipev_spans.json")
        print(step.plan, flush=True)
        print(f"{len(pairs)} overlapped F/B pairs in the table; traces in {out}", flush=True)
    ok = True
    if cuda:
        events = json.loads(path.read_text()).get("traceEvents", [])
        total, hidden = overlap(intervals(events, True), intervals(events, False))
        share = hidden / total if total else 0.0
        ok = share >= args.min_overlap
        print(f"rank {world.rank}: NCCL kernels {total / 1e3:.2f} ms, {share:.0%} of it beside compute kernels "
              f"({'OK' if ok else 'LOW'})", flush=True)
    else:
        print(f"rank {world.rank}: no CUDA device: the kernel overlap is measured on GPUs only", flush=True)
    step.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
