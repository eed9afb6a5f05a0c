"""Does a stage program run as fast inside the step as calibration times it? One GPU, one stage, fx.

    PYTHONPATH=. python benchmarks/program_vs_step.py --calibration cal.json [--model resnet101x4]

Builds resnet101x4 (BatchNorm in train mode, bf16, batch 128 as 8 microbatches of 16) as one stage, calibrated
from `--calibration` (a table `parallelize(calibrate=path)` wrote), and prints, per microbatch: the step's
wall time / 8; calibration's whole-program measurement (`program_scale`: the model's forward and fused backward
back to back on one microbatch), taken again now, warm; and the same programs looped over the 8 real
microbatches. A step slower than both is paying for something outside the programs.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
import ir  # noqa: E402
from engine.planning.calibration import Calibration, program_scale, signature, _costly  # noqa: E402
from examples.resnet_model import build  # noqa: E402


def seconds(run, n: int) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", default=None, help="a table to load (default: calibrate here, fresh)")
    ap.add_argument("--model", default="resnet101x4")
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = build(args.model, classes=1000, base=64).to(dev, torch.bfloat16).train(True)
    fn, variables = engine.functionalize(net, loss=F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 3, 224, 224, generator=g).to(dev, torch.bfloat16)
    y = torch.randint(0, 1000, (128,), generator=g).to(dev)
    m = args.microbatches
    path = args.calibration or "/tmp/program_vs_step_cal.json"
    step = engine.parallelize(fn, variables, x, y, schedule="1f1b", microbatches=m, has_aux=True, compiler="fx",
                              calibrate=path, min_microbatch_size=1)
    local = step.shard(variables)
    step_s = seconds(lambda: step(local, x, y), 5) / m
    cached = torch.cuda.memory_reserved() / 2**30
    torch.cuda.empty_cache()
    emptied = seconds(lambda: step(local, x, y), 5) / m
    print(f"per microbatch: step {step_s * 1e3:.1f} ms with {cached:.1f} GiB reserved; after empty_cache "
          f"{emptied * 1e3:.1f} ms", flush=True)
    gc.disable()
    gc_off = seconds(lambda: step(local, x, y), 5) / m
    gc.enable()
    host = []  # the host's time to issue one step (no sync inside a world-of-one step): what the GPU may wait for
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(local, x, y)
        host.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    print(f"per microbatch: host issues the step in {statistics.median(host) / m * 1e3:.1f} ms", flush=True)

    cal = Calibration.load(path)
    graph = step.graph
    ad = ir.stage_autodiff(graph, constant=range(graph.num_params, len(graph.inputs)), device="cuda",
                           constant_outputs=range(1, len(graph.outputs)))
    params = pytree.tree_leaves(variables)
    size = 128 // m
    inputs = [*params, x[:size], y[:size]]
    fwd, bwd = ad.forward, ad.backward
    keys = [signature(e) for part in (fwd, bwd) for e in part.graph.eqns if _costly(e)]
    summed = sum(cal.times.get(k, 0.0) for k in keys)
    found = program_scale(ad, graph, dev, cal, inputs, repeats=10)
    f_keys = [signature(e) for e in fwd.graph.eqns if _costly(e)]
    f_sum = sum(cal.times.get(k, 0.0) for k in f_keys)  # the whole-program ratio, forward and backward together
    scale_now = (found.forward * f_sum + found.backward * (summed - f_sum)) / summed if summed else 1.0
    print(f"per microbatch: step {step_s * 1e3:.1f} ms (gc off {gc_off * 1e3:.1f}); program_scale now "
          f"{scale_now:.3f} x ops' sum {summed * 1e3:.1f} ms = {scale_now * summed * 1e3:.1f} ms; table's scale "
          f"{cal.scale:.3f} = {cal.scale * summed * 1e3:.1f} ms; plan predicts {step.plan.predicted_step_time / m * 1e3:.1f}"
          f" ms", flush=True)
    # the step's own program as compiled by the runtime, fed each real microbatch in turn
    run_f, run_b = ir.compile_graph(fwd.graph, ()), ir.compile_graph(bwd.graph, ())
    def loop() -> None:
        for k in range(m):
            s = {i: v for i, v in enumerate([*params, x[k * size:(k + 1) * size], y[k * size:(k + 1) * size]])}
            s.update(zip(fwd.out_slots, run_f(*[s[i] for i in fwd.in_slots])))
            b_in = []
            for i in bwd.in_slots:
                if i not in s:  # a cotangent: the loss's is 1/m, the aux outputs' zeros
                    a = ad.slot_avals[i]
                    s[i] = torch.full(a.shape, 1.0 / m, dtype=a.dtype, device=dev) if a.shape == () else \
                        torch.zeros(a.shape, dtype=a.dtype, device=dev)
                b_in.append(s[i])
            run_b(*b_in)

    loop()
    print(f"the same programs looped over {m} microbatches (no accumulation): {seconds(loop, 5) / m * 1e3:.1f} ms a "
          f"microbatch", flush=True)
    step.close()


if __name__ == "__main__":
    main()
