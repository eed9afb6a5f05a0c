"""Plan a 1B-parameter GPT for 8 H100s from one CPU process: trace (fake tensors) + split + choose.

    PYTHONPATH=. python benchmarks/plan_gpt.py [--world 8] [--batch 64] [--device h100] [--schedule 1f1b]
                                               [--calibrate] [--measure]

Prints the seconds `engine.plan` took end to end with stages, dp and microbatches all "auto", the plan
table, and the peak RSS (the weights are meta tensors: nothing of their 2 GB is allocated). Then, for
comparison, the best pure pipeline (stages = world) for the same batch. On a GPU machine, `--calibrate`
first times every op of the training step on the GPU at each candidate microbatch size and plans again
with the measured times; `--measure` runs forward + backward eagerly on one GPU at microbatches 8 and 2
and prints measured against predicted time and activation memory.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ir  # noqa: E402

from engine.planning.calibration import Calibration, calibrate_training  # noqa: E402
from engine.planning.memory import MemoryModel  # noqa: E402
from engine.planning.search import plan  # noqa: E402
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn  # noqa: E402

GPT_1B = GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=18, head_dim=128)


def _timed(label: str, **kw: object) -> None:
    params = init_params(GPT_1B, torch.bfloat16, "meta")
    tokens, targets = example_batch(GPT_1B, kw.pop("batch"), "meta")  # type: ignore[arg-type]
    start = time.perf_counter()
    p = plan(make_loss_fn(GPT_1B), params, tokens, targets, **kw)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    print(f"\n== {label}: planned in {seconds:.2f} s ==")
    print(p)


def _calibration(batch: int, world: int) -> Calibration:
    """Measured op times on this GPU for the microbatch sizes an auto plan of `batch` on `world` tries."""
    params, fn = init_params(GPT_1B, torch.bfloat16, "meta"), make_loss_fn(GPT_1B)
    cal = None
    start = time.perf_counter()
    for size in sorted({batch // d for d in range(1, batch + 1) if batch % d == 0 and batch // d <= batch // world}):
        spec = ir.TensorSpec((size, GPT_1B.seq_len), torch.long)
        cal = calibrate_training(ir.trace(fn, params, spec, spec, device="cuda"), "cuda", calibration=cal)
    assert cal is not None
    print(f"calibrated {len(cal.times)} op signatures on {torch.cuda.get_device_name()} in "
          f"{time.perf_counter() - start:.1f} s")
    return cal


def _measure(fn: object, size: int, repeats: int = 5) -> tuple[float, float, float]:
    """Median forward and forward+backward seconds, and peak activation bytes, eager on this GPU."""
    params = init_params(GPT_1B, torch.bfloat16, "cuda")
    for x in pytree.tree_leaves(params):
        x.requires_grad_(True)
    batch = example_batch(GPT_1B, size, "cuda")
    for _ in range(3):
        fn(params, *batch).backward()  # type: ignore[operator]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # weights and grads
    torch.cuda.reset_peak_memory_stats()
    fwd, both = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            fn(params, *batch)  # type: ignore[operator]
        torch.cuda.synchronize()
        fwd.append(time.perf_counter() - start)
        start = time.perf_counter()
        fn(params, *batch).backward()  # type: ignore[operator]
        torch.cuda.synchronize()
        both.append(time.perf_counter() - start)
    return statistics.median(fwd), statistics.median(both), torch.cuda.max_memory_allocated() - base


def _compare(device: str) -> None:
    fn = make_loss_fn(GPT_1B)
    for size in (8, 2):
        p = plan(fn, init_params(GPT_1B, torch.bfloat16, "meta"), *example_batch(GPT_1B, size, "meta"), stages=1,
                 microbatches=1, device=device)
        s = p.stages[0]
        fwd, both, act = _measure(fn, size)
        predicted_act = s.peak_memory / (1 + MemoryModel().margin) - s.param_bytes * (2 + MemoryModel().optimizer_factor)
        print(f"microbatch {size}: fwd {fwd * 1e3:.1f} ms measured / {s.forward_time * 1e3:.1f} predicted; fwd+bwd "
              f"{both * 1e3:.1f} / {s.time * 1e3:.1f} ms; activations + temporaries {act / 1e9:.2f} / "
              f"{predicted_act / 1e9:.2f} GB ({p.device} profile)")
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="global batch, sequences of 1024 tokens")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--calibrate", action="store_true", help="time the ops on this machine's GPU, then plan again")
    ap.add_argument("--measure", action="store_true", help="compare predictions with eager runs on this GPU")
    args = ap.parse_args()
    print(f"GPT {GPT_1B.num_params() / 1e9:.2f} B params (d={GPT_1B.d_model}, {GPT_1B.n_layers} layers, "
          f"vocab {GPT_1B.vocab_size}, seq {GPT_1B.seq_len}), bf16; global batch {args.batch}; "
          f"{args.world} x {args.device}; torch {torch.__version__}")
    common = dict(world_size=args.world, device=args.device, schedule=args.schedule, batch=args.batch)
    _timed("auto: stages, dp and microbatches", stages="auto", dp="auto", microbatches="auto", **common)
    _timed(f"pure pipeline: {args.world} stages, microbatches auto", stages=args.world, microbatches="auto", **common)
    if args.calibrate:
        cal = _calibration(args.batch, args.world)
        _timed("auto, calibrated", stages="auto", dp="auto", microbatches="auto", calibration=cal, **common)
        _timed("pure pipeline, calibrated", stages=args.world, microbatches="auto", calibration=cal, **common)
    if args.measure:
        _compare("cuda")
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MB")


if __name__ == "__main__":
    main()
