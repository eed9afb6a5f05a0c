"""Does a stage program run slower while a transfer is posted beside it? Two ranks, one pair of GPUs.

    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/contention.py [--layers 4] [--mb 16]

Each rank runs the same compiled Llama piece (forward and backward of `--layers` blocks of the 0.85 B model,
bf16, microbatch 4 x 1024) `--iters` times, timed by CUDA events on its compute stream, under each condition:

- alone: nothing else on the GPU;
- pending recv: a receive of `--mb` MB from the peer posted first, its send made only after the timed work
  (NCCL's kernel waits on the GPU all the while: what a receive posted ahead of its sender costs);
- streaming: one send and one receive of `--mb` MB each way per iteration, posted before it (a pipeline's
  traffic, through one-way communicators as fnpipe's transport has them);
- copy engine: the same bytes per iteration pushed to the peer GPU by `copy_` on a side stream (no SMs).

Prints ms per iteration and the ratio to alone, per rank; NCCL settings come from the environment, so run it
once per setting to compare (e.g. NCCL_MAX_P2P_NCHANNELS).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples import llama_model  # noqa: E402


def timed(work, iters: int, before=None) -> float:
    """Median ms of `work` per iteration over three rounds of `iters`, CUDA events on the current stream."""
    rounds = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.current_stream().synchronize()  # not the device: a posted receive would never finish
        start.record()
        for i in range(iters):
            if before is not None:
                before(i)
            work()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / iters)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--mb", type=int, default=16, help="message size in MB")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    cpu = dist.new_group(backend="gloo")
    out_ch = {(a, b): dist.new_group([a, b] if a < b else [b, a]) for a in range(world) for b in range(world)
              if a != b and a ^ 1 == b}  # one communicator per direction, created in the same order everywhere
    send_g, recv_g = out_ch[(rank, peer)], out_ch[(peer, rank)]

    config = llama_model.CONFIGS["0.85b"]
    config = attrs.evolve(config, n_layers=args.layers)
    model = llama_model.build(config, torch.bfloat16, dev)
    model.embed, model.norm, model.head = None, None, None
    block = torch.compile(model)
    x = torch.randn(4, config.seq_len, config.d_model, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def work() -> None:
        block(x).float().square().mean().backward()

    for _ in range(3):
        work()
    n = args.mb * 2 ** 20 // 2
    msgs_out = [torch.ones(n, device=dev, dtype=torch.bfloat16) for _ in range(args.iters)]
    msgs_in = [torch.empty(n, device=dev, dtype=torch.bfloat16) for _ in range(args.iters)]
    probe = torch.zeros(1, device=dev)
    for g, op in ((send_g, dist.isend), (recv_g, dist.irecv)) if rank < peer else ((recv_g, dist.irecv), (send_g, dist.isend)):
        op(probe, peer, group=g).wait()  # connect both communicators before anything is timed
    torch.cuda.synchronize()
    rows = {}
    rows["alone"] = timed(work, args.iters)

    def pending() -> float:
        work_in = dist.irecv(msgs_in[0], peer, group=recv_g)
        ms = timed(work, args.iters)
        dist.barrier(group=cpu)
        dist.isend(msgs_out[0], peer, group=send_g).wait()
        work_in.wait()
        torch.cuda.synchronize()
        return ms

    rows["pending recv"] = pending()
    sent: list = []

    def stream_one(i: int) -> None:
        sent.append(dist.isend(msgs_out[i], peer, group=send_g))
        sent.append(dist.irecv(msgs_in[i], peer, group=recv_g))

    def streaming() -> float:
        ms = timed(work, args.iters, before=stream_one)
        for w in sent:
            w.wait()
        sent.clear()
        torch.cuda.synchronize()
        return ms

    rows["streaming"] = streaming()
    other = torch.device("cuda", (local ^ 1) % torch.cuda.device_count())
    remote = [torch.empty(n, device=other, dtype=torch.bfloat16) for _ in range(2)]
    side = torch.cuda.Stream(dev)

    def copy_one(i: int) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            remote[i % 2].copy_(msgs_out[i], non_blocking=True)

    rows["copy engine"] = timed(work, args.iters, before=copy_one)
    torch.cuda.synchronize()
    rows["alone again"] = timed(work, args.iters)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows, group=cpu)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_") and k != "NCCL_NVLS_ENABLE"}
        print(f"\n{torch.cuda.get_device_name()}, nccl {torch.cuda.nccl.version()}, {args.layers} Llama blocks, "
              f"{args.mb} MB messages, env {env or 'default'}")
        print("| condition | " + " | ".join(f"rank {r} ms" for r in range(world)) + " | x alone (rank 0) |")
        print("|---|" + "---|" * (world + 1))
        for name in rows:
            ms = [g[name] for g in gathered]
            print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in ms) + f" | {ms[0] / gathered[0]['alone']:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
