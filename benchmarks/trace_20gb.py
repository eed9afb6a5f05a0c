"""Trace a model with more than 20 GB of float32 parameters and report peak RSS and seconds.

    PYTHONPATH=. python benchmarks/trace_20gb.py [--layers 40] [--width 12288] [--meta] [--json]

Params are `ir.TensorSpec`s (meta tensors with --meta): shapes only, so tracing must not allocate
them. Issue #2 asks for < 1 GB peak RSS and < 30 s. Peak RSS is VmHWM from /proc/self/status
(ru_maxrss where that is missing) and covers the whole process, `import torch` included.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import ir


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for layer in params["layers"]:
        h = F.gelu(h @ layer["w"] + layer["b"])
    return F.mse_loss(h, y)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--width", type=int, default=12288)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--meta", action="store_true", help="params as meta tensors instead of ir.TensorSpec")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = ap.parse_args(argv)
    w = args.width

    def leaf(*shape: int) -> torch.Tensor | ir.TensorSpec:
        return torch.empty(shape, device="meta") if args.meta else ir.TensorSpec(shape)

    params = {"layers": [{"w": leaf(w, w), "b": leaf(w)} for _ in range(args.layers)]}
    x, y = ir.TensorSpec((args.batch, w)), ir.TensorSpec((args.batch, w))
    rss_before = peak_rss_bytes()
    t0 = time.perf_counter()
    graph = ir.trace(loss_fn, params, x, y)
    seconds = time.perf_counter() - t0
    report = {"leaves": "meta" if args.meta else "TensorSpec",
              "param_gb": args.layers * (w * w + w) * 4 / 1e9,
              "graph_param_gb": sum(v.aval.nbytes for v in graph.params) / 1e9,
              "eqns": len(graph.eqns), "trace_s": seconds,
              "peak_rss_mb": peak_rss_bytes() / 1e6, "rss_before_trace_mb": rss_before / 1e6}
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>20}  {v:.3f}" if isinstance(v, float) else f"{k:>20}  {v}")
    return report


if __name__ == "__main__":
    main()
