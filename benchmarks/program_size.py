"""How much host work a pipelined step asks for, read off the stage programs (no GPU needed).

    PYTHONPATH=. python benchmarks/program_size.py [--model resnet101x4] [--microbatches 8] [--stages 2]

A wide ResNet with BatchNorm in train mode, bf16, batch 128 at 224x224, planned for `--stages` CUDA ranks
(traced on the meta device, as on a CPU-only machine): per stage, the equations of its forward and of its
fused backward (each one an op dispatched from Python in fx mode: host time per microbatch) and the tensors
it sends per microbatch (each a transfer, packed by `engine.execution.packing` when small). On two H200s
(2026-11-23, fx) the step of the session-5 programs was host-bound at 3,408 equations and 271 sends per
microbatch (`benchmarks/diagnose_p2.py`).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine
from engine.planning.search import search
from examples.resnet_model import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet101x4")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--stages", type=int, default=2)
    args = ap.parse_args()
    with torch.device("meta"):
        net = build(args.model, classes=1000, base=64)
    fn, variables = engine.functionalize(net.to(torch.bfloat16).train(), loss=F.cross_entropy)
    x = torch.empty(128, 3, 224, 224, dtype=torch.bfloat16, device="meta")
    y = torch.empty(128, dtype=torch.int64, device="meta")
    t = time.perf_counter()
    planned = search(fn, variables, x, y, world_size=args.stages, schedule="1f1b", microbatches=args.microbatches,
                     device="cuda", has_aux=True, min_microbatch_size=1, stages=args.stages)
    print(f"{args.model}, BN train, bf16, {args.stages} stages, {args.microbatches} microbatches: planned in "
          f"{time.perf_counter() - t:.1f} s, cuts {list(planned.plan.cuts)}")
    total = 0
    for st in planned.stages:
        f, b = len(st.ad.forward.graph.eqns), len(st.ad.backward.graph.eqns)
        total += f + b
        print(f"  stage {st.stage.index}: F {f} equations, BW {b}, sends {len(st.stage.acts_out)} tensors per "
              f"microbatch ({len(st.stage.frozen_out)} with no gradient)")
    print(f"equations per microbatch, every stage's F and BW: {total}")


if __name__ == "__main__":
    main()
