"""The benchmark's zbv plan at p = 4 made on CPU from a GPU's calibration: per stage and per rank F + B + W.

    PYTHONPATH=. python benchmarks/plan_zbv.py --family gpt --calibrate benchmarks/results/2026-11-27-s20/call3-fourcal

Plans what `gpu_pipeline.py` plans on 4 GPUs (16 blocks, bf16, 8 microbatches of 4, compiler inductor) from the
calibration table `cal_<family>.json` of that directory, with meta tensors (nothing is allocated), and prints each
stage's planned milliseconds a microbatch, each rank's sum over its stages, the predicted step and its bubble:
where the plan's step goes, without a GPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.families import family  # noqa: E402
from engine.planning.artifacts import Workshop  # noqa: E402
from engine.planning.calibration import Calibration  # noqa: E402
from engine.planning.search import search  # noqa: E402


def rank_loads(plan) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds of F + B + W a microbatch per rank, over the stages it holds."""
    loads = [0.0] * plan.pipeline_depth
    for st in plan.stages:
        loads[st.rank] += st.forward_time + st.backward_input_time + st.backward_weight_time
    return loads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="gpt")
    ap.add_argument("--calibrate", required=True, help="directory holding cal_<family>.json")
    ap.add_argument("--schedule", default="zbv")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--device", default="h100")
    ap.add_argument("--trace-on", default="cuda", help="the device the tracer fakes (cpu where a CPU build of torch "
                    "cannot trace the model on fake CUDA tensors, as the Llama's RoPE)")
    a = ap.parse_args(argv)
    fam = family(a.family, "base")
    params = fam.params(torch.bfloat16, "meta", 0)
    tokens, targets = fam.batch(32, 0)
    cal = Calibration.load(Path(a.calibrate) / f"cal_{a.family}.json").for_compiler("inductor")
    start = time.perf_counter()
    workshop = Workshop(fam.loss_fn(), params, (tokens, targets), device=a.trace_on)
    planned = search(fam.loss_fn(), params, tokens, targets, world_size=a.world, schedule=a.schedule,
                     microbatches=8, device=a.device, calibration=cal, fused_recompute=True, workshop=workshop)
    plan = planned.plan
    print(f"planned in {time.perf_counter() - start:.1f} s")
    print(f"{'stage':>5} {'rank':>4} {'eqns':>10} {'F ms':>6} {'B ms':>6} {'W ms':>6} {'sum':>6}")
    for k, st in enumerate(plan.stages):
        total = st.forward_time + st.backward_input_time + st.backward_weight_time
        print(f"{k:>5} {st.rank:>4} {f'{st.start}:{st.stop}':>10} {st.forward_time * 1e3:6.2f} "
              f"{st.backward_input_time * 1e3:6.2f} {st.backward_weight_time * 1e3:6.2f} {total * 1e3:6.2f}")
    loads = rank_loads(plan)
    mean = sum(loads) / len(loads)
    print("per rank a microbatch ms: " + " / ".join(f"{x * 1e3:.2f}" for x in loads)
          + f"; the largest {max(loads) / mean:.3f} x the mean")
    work = max(loads) * plan.microbatches
    print(f"predicted step {plan.predicted_step_time * 1e3:.2f} ms: the busiest rank's work {work * 1e3:.2f} ms, the mean "
          f"rank's {mean * plan.microbatches * 1e3:.2f} ms; step / mean work {plan.predicted_step_time / (mean * plan.microbatches):.3f}")


if __name__ == "__main__":
    main()
