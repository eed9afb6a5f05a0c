"""The planner's stage costs against the stage programs timed in turn, on one GPU: does the calibration cost each
stage of a p = 4 plan as its programs run, and did timing the head as a piece of its own change that?

    PYTHONPATH=. python benchmarks/stage_check.py [--families gpt,llama] [--schedule zbv] [--world 4]
                                                  [--tables before,now] [--out-dir DIR]
    PYTHONPATH=. python benchmarks/stage_check.py --size tiny --device cpu --compiler fx   # a CPU smoke test

For each family (the benchmark's 16 blocks, bf16, 8 microbatches of 4, inductor): the op table and the whole
model's program scale and its region scales timed here (`calibrate_training`, `region_scale`), then its pieces
twice (`piece_scale`): as before session 30 (no piece of a kind of its own timed: `pieces.SINGLE` above 1) and as
now (the head timed).
Each table plans the benchmark's `--schedule` at `--world` ranks (the plan a `--world`-GPU launch makes from this
calibration), and every stage of each plan has its forward, B and W programs (as the runtime makes them:
`Planned.stages`) compiled and timed on this GPU, each behind a spin of the device as calibration times them.
Prints per plan and stage the planned and the measured milliseconds a microbatch and their ratio, and per rank
its stages' sum: the busiest rank over the mean, planned and measured (what "of ideal" loses to the split). The
in-step slowdown of a real p = 4 step (NOTES.md) is not in this: it checks the costs, not the step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.families import family  # noqa: E402
from engine.execution.compilers import COMPILERS  # noqa: E402
from engine.execution.step import microbatch_example  # noqa: E402
from engine.planning import pieces  # noqa: E402
from engine.planning.artifacts import Workshop  # noqa: E402
from engine.planning.calibration import Calibration, Programs, calibrate_training, ops_sums  # noqa: E402
from engine.planning.measured import MeasuredScale, batch_key  # noqa: E402
from engine.planning.regions import region_scale  # noqa: E402
from engine.planning.search import search  # noqa: E402

MICROBATCHES, ROWS = 8, 4


TABLES = {"before": 2.0, "now": pieces.SINGLE}  # a table -> its pieces.SINGLE (above 1: no piece of its own)


def tables(fam: Any, workshop: Workshop, dev: torch.device, out: Path, compiler: str,
           names: list[str]) -> dict[str, Calibration]:
    """The op table, program scale and region scales timed once, then each of `names`' pieces (TABLES) spread
    over the same regions: the tables differ by their pieces alone."""
    example = microbatch_example(workshop.batch, MICROBATCHES)
    graph = workshop.graph(ROWS)
    real = pytree.tree_leaves((workshop.params, example))
    started = time.perf_counter()
    others = {} if compiler == "fx" else {compiler: COMPILERS[compiler]}
    base = calibrate_training(graph, dev, inputs=real, compile_program=COMPILERS["fx"], compiled=others)
    print(f"{fam.name}: ops and program scale timed in {time.perf_counter() - started:.0f} s", flush=True)
    level = False if compiler == "fx" else "cheap"  # as `regions.with_regions` times them
    started = time.perf_counter()
    region, base = region_scale(graph, dev, base, real, level=level, compile_program=COMPILERS[compiler])
    print(f"{fam.name}: regions timed in {time.perf_counter() - started:.0f} s", flush=True)
    made = {}
    for name, single in ((n, TABLES[n]) for n in names):
        saved, pieces.SINGLE = pieces.SINGLE, single
        try:
            started = time.perf_counter()
            if region is None:
                scale, cal = MeasuredScale(len(graph.eqns), (), batch_key(graph)), base
            else:
                scale, cal = pieces.piece_scale(graph, dev, region, base, real, level=level,
                                                compile_program=COMPILERS[compiler])
            made[name] = attrs.evolve(cal, regions={compiler: scale})
        finally:
            pieces.SINGLE = saved
        made[name].save(out / f"cal_{fam.name}_{name}.json")
        region = made[name].regions[compiler]
        print(f"{fam.name} {name}: pieces in {time.perf_counter() - started:.0f} s: "
              f"{len(region.spans)} spans", flush=True)
    return made


def timed_stage(info: Any, workshop: Workshop, dev: torch.device, cal: Calibration,
                compiler: str) -> tuple[float, float, float]:
    """A plan stage's forward, B and W programs (`compiler`'s) timed on `dev`: seconds a microbatch each."""
    example = microbatch_example(workshop.batch, MICROBATCHES)
    real = pytree.tree_leaves((workshop.params, example))
    stage, ad = info.stage, info.ad
    sums = ops_sums(ad, stage.graph, cal)
    ins = [real[i] for i in (*stage.param_ids, *stage.batch_ids)]
    programs = Programs(ad, dev, ins, sums.accumulate, sums.param_grads, COMPILERS[compiler], split=True,
                        queued=True)
    ran = programs.timed(5)
    del programs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ran.forward, ran.backward_input or 0.0, ran.backward_weight or 0.0


def check(fam: Any, workshop: Workshop, dev: torch.device, cals: dict[str, Calibration], a: argparse.Namespace,
          measured: dict[tuple[Any, ...], tuple[float, float, float]]) -> list[dict[str, Any]]:
    rows = []
    for name, cal in cals.items():
        started = time.perf_counter()
        planned = search(fam.loss_fn(), workshop.params, *workshop.batch, world_size=a.world, schedule=a.schedule,
                         microbatches=MICROBATCHES, device=dev.type, calibration=cal.for_compiler(a.compiler),
                         fused_recompute=a.compiler == "inductor", workshop=workshop)
        plan = planned.plan
        print(f"\n{fam.name} {name}: {a.schedule} at p = {a.world} planned in {time.perf_counter() - started:.1f} s,"
              f" predicted step {plan.predicted_step_time * 1e3:.2f} ms", flush=True)
        print(f"{'stage':>5} {'rank':>4} {'eqns':>9} {'F ms':>6} {'B ms':>6} {'W ms':>6} | {'F meas':>6} {'B meas':>6} "
              f"{'W meas':>6} | {'F x':>5} {'B x':>5} {'W x':>5} {'sum x':>5}")
        loads, ran_loads = [0.0] * plan.pipeline_depth, [0.0] * plan.pipeline_depth
        for st, info in zip(plan.stages, planned.stages):
            key = (st.start, st.stop, plan.recompute[st.index], plan.remat[st.index])
            if key not in measured:
                measured[key] = timed_stage(info, workshop, dev, cal, a.compiler)
            f, b, w = measured[key]
            want = (st.forward_time, st.backward_input_time, st.backward_weight_time)
            loads[st.rank] += sum(want)
            ran_loads[st.rank] += f + b + w
            ratios = [x / y if y > 0 else float("nan") for x, y in zip((f, b, w, f + b + w), (*want, sum(want)))]
            print(f"{st.index:>5} {st.rank:>4} {f'{st.start}:{st.stop}':>9} "
                  + " ".join(f"{x * 1e3:6.2f}" for x in want) + " | " + " ".join(f"{x * 1e3:6.2f}" for x in (f, b, w))
                  + " | " + " ".join(f"{x:5.2f}" for x in ratios), flush=True)
            rows.append({"family": fam.name, "table": name, "stage": st.index, "rank": st.rank, "start": st.start,
                         "stop": st.stop, "planned": want, "measured": (f, b, w)})
        mean, ran_mean = sum(loads) / len(loads), sum(ran_loads) / len(ran_loads)
        print("per rank ms a microbatch, planned: " + " / ".join(f"{x * 1e3:.2f}" for x in loads)
              + f" (busiest {max(loads) / mean:.3f} x the mean); measured: "
              + " / ".join(f"{x * 1e3:.2f}" for x in ran_loads) + f" (busiest {max(ran_loads) / ran_mean:.3f} x the"
              f" mean); measured / planned per rank: " + " / ".join(f"{r / p:.3f}" for r, p in zip(ran_loads, loads)),
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="gpt,llama")
    ap.add_argument("--schedule", default="zbv")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--out-dir", default="out")
    ap.add_argument("--size", default="base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compiler", default="inductor", choices=sorted(COMPILERS))
    ap.add_argument("--tables", default="before,now", help="which calibrations plan: before (no piece of a kind "
                    "of its own timed), now")
    a = ap.parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows: list[dict[str, Any]] = []
    for name in a.families.split(","):
        fam = family(name, a.size)
        params = fam.params(dtype, dev, 0)
        tokens, targets = fam.batch(MICROBATCHES * ROWS, 0)
        workshop = Workshop(fam.loss_fn(), params, (tokens.to(dev), targets.to(dev)), device=dev.type)
        cals = tables(fam, workshop, dev, out, a.compiler, a.tables.split(","))
        rows += check(fam, workshop, dev, cals, a, {})
        (out / "stage_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
