"""Offline (CPU): the Llama's second stage of session 30's p = 4 zbv plan (eqns 121:245, inside the first region),
costed from call 3's calibration as it was and with the first region's B and W split as the other regions' were
(the spans edited here; the engine does not do it: tried in session 30 and reverted, benchmarks/NOTES.md), beside
what its programs ran on the H200 (`stage_check.py`, call 3).

    PYTHONPATH=. python benchmarks/first_region_split.py

The factors 0.81 (B) and 1.71 (W) are the other regions' B and W ratios over their whole backward's, read off call
3's log (`regions run ... B x0.77 W x1.64 BW x0.95`, x0.77 / x1.63 / x0.94, x0.87 / x1.82 / x1.10). The first
stage (eqns 0:121) costs its backward at the whole backward's ratio either way (`stage_costs._scales`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.families import family  # noqa: E402
from engine.planning.artifacts import Workshop  # noqa: E402
from engine.planning.calibration import Calibration  # noqa: E402
from engine.planning.devices import get_device, get_link  # noqa: E402
from engine.planning.measured import MeasuredScale  # noqa: E402
from engine.planning.op_costs import CostModel  # noqa: E402
from engine.planning.stage_costs import exact  # noqa: E402

TABLE = "benchmarks/results/2026-11-28-s30/call3-fxcalls-llama-stages/sc/cal_llama_before.json"
FIRST_REGION, KB, KW = 259, 0.81, 1.71
RAN = {"F": 1.31, "B": 1.72, "W": 1.44}  # stage 1's programs in turn on the H200, ms (call 3's sc.txt)


def main() -> None:
    fam = family("llama", "base")
    tokens, targets = fam.batch(32, 0)
    graph = Workshop(fam.loss_fn(), fam.params(torch.bfloat16, "meta", 0), (tokens, targets), device="cpu").graph(4)
    cal = Calibration.load(TABLE).for_compiler("inductor")
    region = cal.region
    assert region is not None and region.num_eqns == len(graph.eqns)
    split = [attrs.evolve(s, backward_input=s.backward_input * KB, backward_weight=s.backward_weight * KW)
             if s.start < FIRST_REGION else s for s in region.spans]
    tables = {"one ratio for B and W (as planned)": cal,
              "split as the other regions'": attrs.evolve(cal, regions={
                  **cal.regions, "inductor": MeasuredScale(region.num_eqns, split, region.batch)})}
    dev = get_device("h200")
    print(f"{'stage 121:245, ms a microbatch':36} {'F':>6} {'B':>6} {'W':>6} | run / plan F, B, W | stage 0's W")
    for name, table in tables.items():
        model = CostModel(dev, get_link(None, dev), table, split_backward=True)
        first, second, _ = exact(graph, [121, 245], model, recompute=("cheap",) * 3)
        plan = (second.forward, second.backward_input, second.backward_weight)
        ratios = " ".join(f"{RAN[k] / (x * 1e3):.2f}" for k, x in zip("FBW", plan))
        print(f"{name:36} " + " ".join(f"{x * 1e3:6.2f}" for x in plan) + f" | {ratios:18} | "
              f"{first.backward_weight * 1e3:.2f}")
    print("ran (H200, call 3): " + ", ".join(f"{k} {v:.2f}" for k, v in RAN.items()))


if __name__ == "__main__":
    main()
