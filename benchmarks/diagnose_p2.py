"""Where a pipelined step's time goes, per rank: kernels, NCCL, idle GPU, host syncs, against the plan.

    # 2 GPUs: one family per launch or several (gpt, llama, resnet), fnpipe 1f1b, fx and/or inductor
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/diagnose_p2.py --families llama,resnet --compilers fx
    # 4 GPUs, zbv, the stage programs timed again after the steps (is the device's state what differs?)
    PYTHONPATH=. torchrun --nproc_per_node 4 benchmarks/diagnose_p2.py --families gpt,llama --compilers auto \
        --schedule zbv --remeasure
    # CPU smoke (gloo, tiny sizes)
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/diagnose_p2.py --tiny

For each row it prints `engine.report.compare` (each stage's measured F/B against the plan's prediction,
from `step.traced`), `engine.report.against_programs` (each rank's programs as timed at start-up against
the same programs in the step, what it waited for receives, and the step simulated from either),
`engine.report.beside_receives` (the same ratio for computes that ran beside a receive still waiting for its
data, and for the others), each program's kernels and span in a step against the same program timed in turn
(`program_kernels.py`: slower kernels, or gaps between them) and, from a
`torch.profiler` trace of one step on each rank: the step's wall time, the time some compute kernel runs
(union), the sum of kernel times against the rank's programs at start-up, the NCCL kernel time, the GPU's
idle time, the host-side synchronising calls (cudaStreamSynchronize, cudaDeviceSynchronize,
cudaEventSynchronize, blocking memcpy) and the kernels that take the most time. A step that is slower than
predicted while its kernels take what the plan says is waiting: on a peer, on the host, or on a sync.
Rank 0 writes `$OUT/spans_<family>_<compiler>_<schedule>.json` (every rank's spans, the lowered table, the
profile) for offline analysis, and each rank its profiler trace.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine
from benchmarks import program_kernels
from benchmarks.families import family
from engine import report
from engine.execution.profile import KIND, from_spans, gather, program_label

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ", "cudaMemcpy(")


def union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def kernel_stats(path: Path, wall_us: float) -> dict[str, Any]:
    events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    nccl = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels if "nccl" in e.get("name", "").lower()]
    comp = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels if "nccl" not in e.get("name", "").lower()]
    by_name: Counter[str] = Counter()
    for e in kernels:
        if "nccl" not in e.get("name", "").lower():
            by_name[e["name"][:60]] += e.get("dur", 0)
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    syncs = Counter(e["name"] for e in runtime if any(e["name"].startswith(s.strip("( ")) and
                                                      not e["name"].startswith("cudaMemcpyAsync") for s in SYNCS))
    sync_us = sum(e.get("dur", 0) for e in runtime if e["name"] in syncs)
    span = (min(a for a, _ in comp + nccl), max(b for _, b in comp + nccl)) if comp or nccl else (0.0, 0.0)
    busy = union(comp)
    return {"wall_ms": wall_us / 1e3, "gpu_span_ms": (span[1] - span[0]) / 1e3, "compute_ms": busy / 1e3,
            "compute_sum_ms": sum(b - a for a, b in comp) / 1e3, "nccl_ms": union(nccl) / 1e3,
            "idle_ms": (span[1] - span[0] - union(comp + nccl)) / 1e3, "kernels": len(comp),
            "syncs": dict(syncs), "sync_ms": sync_us / 1e3,
            "top": [(n, round(d / 1e3, 2)) for n, d in by_name.most_common(8)]}


def by_program(step: Any, local: Any, batch: tuple, stem: Path) -> str:
    """One step profiled with each compute named by its program, then the programs timed in turn under the
    profiler too (`profile_programs`, a collective; the step keeps its first profile): their kernels side by
    side (`benchmarks/program_kernels.py`)."""
    cuda = step.world.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])  # CPU: no kernels, an empty table
    barrier()
    step.executor.annotate = True
    try:
        with profile(activities=activities) as prof:
            step(local, *batch)
            if cuda:
                torch.cuda.synchronize()
    finally:
        step.executor.annotate = False
    prof.export_chrome_trace(f"{stem}_step.json")
    first = step.profile
    with profile(activities=activities) as prof:
        step.profile_programs(*batch, passes=1)
        if cuda:
            torch.cuda.synchronize()
    step.profile = first
    prof.export_chrome_trace(f"{stem}_in_turn.json")
    step_events, turn_events = (json.loads(Path(f"{stem}_{part}.json").read_text()).get("traceEvents", [])
                                for part in ("step", "in_turn"))
    in_step, in_turn = program_kernels.ranges(step_events), program_kernels.ranges(turn_events)
    return (f"{program_kernels.compare(in_step, in_turn)}\nthe idle time inside each program's span\n"
            f"{program_kernels.gaps(in_step, in_turn)}")


def llm_case(name: str, size: str, m: int, mb: int, dtype: torch.dtype, device: torch.device):
    fam = family(name, size)
    params = fam.params(dtype, device, 0)
    if dist.is_initialized():
        for leaf in torch.utils._pytree.tree_leaves(params):
            dist.broadcast(leaf, src=0)
    x, y = fam.batch(m * mb, seed=1)
    return fam.loss_fn(), params, (x.to(device), y.to(device)), {}


def resnet_case(tiny: bool, m: int, dtype: torch.dtype, device: torch.device):
    from examples.resnet_model import build

    torch.manual_seed(0)
    net = build("resnet50x1" if tiny else "resnet101x4", classes=10 if tiny else 1000, base=4 if tiny else 64)
    net = net.to(device=device, dtype=dtype).train(True)
    fn, variables = engine.functionalize(net, loss=F.cross_entropy)
    g = torch.Generator().manual_seed(1)
    batch, image = (32, 32) if tiny else (128, 224)
    x = torch.randn(batch, 3, image, image, generator=g).to(device, dtype)
    y = torch.randint(0, 10 if tiny else 1000, (batch,), generator=g).to(device)
    return fn, variables, (x, y), {"has_aux": True, "min_microbatch_size": 1}


def program_compute_ms(step: Any) -> float | None:
    """This rank's compute instructions of one step, each at its program's seconds measured before the first
    step (`step.profile`): what its kernels would take if the step ran them as they ran alone, in turn."""
    if step.profile is None:
        return None
    total = 0.0
    for ins in step.programs[step.world.rank].instrs:
        if ins.kind in KIND:
            cost = step.profile.of((ins.stage, ins.kind, ins.accumulated()))
            if cost is None:
                return None
            total += cost.seconds
    return total * 1e3


def remeasured(step: Any, batch: tuple, world: Any) -> dict[str, float] | None:
    """The stage programs timed again right after the timed steps (a device that has been busy for a while,
    where `parallelize` timed them on one that had been compiling), in one pass: each program's seconds now
    over its start-up seconds (the faster of two passes), over every rank's programs. The step keeps its
    first profile."""
    first = step.profile
    if first is None:
        return None
    now = step.profile_programs(*batch, passes=1)
    step.profile = first
    ratios = [b.seconds / a.seconds for a in first.programs for b in now.programs
              if a.key == b.key and a.seconds > 0]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def on_real_data(step: Any, local: Any, batch: tuple, every: Any) -> tuple[str | None, Any]:
    """Is a program slower in a step because of its data? One more step with the executor's capture on, then
    each captured program timed in turn on the operands that step gave it (`Executor.measure_captured`: the
    real activations and cotangents where start-up timing uses small random stand-ins), every rank's, beside
    the start-up seconds and the programs' median time in the traced step (`profile.from_spans`). A
    collective; the table (every rank's programs) and the gathered Profile on the real data; (None, None)
    without a start-up profile. The executor keeps its capture (`host_costs` reuses it)."""
    if step.profile is None:
        return None, None
    ex = step.executor
    ex.capture = {}
    step(local, *batch)
    real = gather(ex.measure_captured(), step.transport.all_gather_json)
    in_step = from_spans(every, step.programs.all())
    rows = [f"{'program':>8} {'start-up ms':>12} {'real data ms':>13} {'in step ms':>11} {'data/start':>11} "
            f"{'step/data':>10}"]
    sums = [0.0, 0.0, 0.0]
    for p in sorted(real.programs, key=lambda p: p.key):
        a, c = step.profile.of(p.key), in_step.of(p.key)
        if a is None or c is None:
            continue
        sums = [sums[0] + a.seconds, sums[1] + p.seconds, sums[2] + c.seconds]
        rows.append(f"{program_label(p.key):>8} {a.seconds * 1e3:12.3f} {p.seconds * 1e3:13.3f} {c.seconds * 1e3:11.3f} "
                    f"{p.seconds / a.seconds:11.3f} {c.seconds / p.seconds:10.3f}")
    if sums[0] > 0 and sums[1] > 0:
        rows.append(f"{'all':>8} {sums[0] * 1e3:12.3f} {sums[1] * 1e3:13.3f} {sums[2] * 1e3:11.3f} "
                    f"{sums[1] / sums[0]:11.3f} {sums[2] / sums[1]:10.3f}")
    return "\n".join(rows), real


def host_costs(step: Any, local: Any, batch: tuple) -> dict[str, Any]:
    """Where the host's time goes in one step, without a profiler: a mark at each instruction the executor
    runs (its hook), so each instruction is charged the host time to the next mark, by program
    (`program_label`) or instruction kind; the step's call to its first instruction ("before"), its last
    mark to the call's return ("after"), and the wall time to the device's end. With the captured programs
    (`on_real_data` first), each one's launch time from an idle device too: the host's cost of a run. A
    rank whose host needs about what its device does is launch-bound in a step."""
    ex, device = step.executor, step.world.device
    marks: list[tuple[float, str]] = []

    def hook(_: Any, ins: Any) -> None:
        label = program_label((ins.stage, ins.kind, ins.accumulated())) if ins.kind in KIND else ins.kind
        marks.append((time.perf_counter(), label))

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _d=None: None)
    old, ex.hook = ex.hook, hook
    try:
        sync(device)
        t0 = time.perf_counter()
        step(local, *batch)
        t_ret = time.perf_counter()
        sync(device)
        t_end = time.perf_counter()
    finally:
        ex.hook = old
    per: dict[str, list[float]] = {}
    for (t, label), (t_next, _) in zip(marks, marks[1:] + [(t_ret, "")]):
        per.setdefault(label, []).append(t_next - t)
    launch, graphed = {}, {}
    for key, (args, accs) in sorted((ex.capture or {}).items()):
        fn, zeros = ex._part(*key), [torch.zeros_like(a) for a in accs]
        times = []
        for _ in range(5):
            sync(device)
            t = time.perf_counter()
            fn(*args, *zeros)
            times.append(time.perf_counter() - t)
        launch[program_label(key)] = statistics.median(times) * 1e3
        if device.type == "cuda":
            graphed[program_label(key)] = graph_costs(lambda: fn(*args, *zeros), device)
    return {"rank": step.world.rank, "before_ms": (marks[0][0] - t0) * 1e3 if marks else 0.0,
            "loop_ms": (marks[-1][0] - marks[0][0]) * 1e3 if marks else 0.0,
            "after_ms": (t_ret - marks[-1][0]) * 1e3 if marks else 0.0, "wall_ms": (t_end - t0) * 1e3,
            "per": {k: [len(v), sum(v) * 1e3] for k, v in per.items()}, "launch_ms": launch, "graphed": graphed}


def graph_costs(run: Any, device: torch.device) -> list[float] | None:
    """`run` captured as one CUDA graph: [host ms to launch a replay, device ms a replay (10 back to back)];
    None where capture fails. How much of a program's launch cost a graph would take away."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        torch.cuda.synchronize(device)
        host = []
        for _ in range(5):
            t = time.perf_counter()
            graph.replay()
            host.append(time.perf_counter() - t)
            torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        out = [statistics.median(host) * 1e3, start.elapsed_time(end) / 10]
        del graph
        return out
    except Exception as e:  # noqa: BLE001 -- a diagnostic: say what failed, go on
        print(f"graph capture failed: {type(e).__name__}: {e}", flush=True)
        return None


def host_table(rows: list[dict[str, Any]], real: Any) -> str:
    """`host_costs` of every rank as text: the step's host phases, then per program or instruction kind its
    count, host ms in the step, host ms a run from idle (launch) and device ms a run (in turn, real data)."""
    out = []
    for r in rows:
        out.append(f"rank {r['rank']}: host before the first instruction {r['before_ms']:.2f} ms, instruction loop "
                   f"{r['loop_ms']:.2f} ms, after the last {r['after_ms']:.2f} ms; wall to the device's end "
                   f"{r['wall_ms']:.2f} ms")
        out.append(f"{'what':>10} {'n':>4} {'host ms':>9} {'host/run':>9} {'launch ms':>10} {'device ms':>10} "
                   f"{'graph launch':>13} {'graph device':>13}")
        for label, (n, ms) in sorted(r["per"].items(), key=lambda kv: -kv[1][1]):
            dev = next((p.seconds * 1e3 for p in (real.programs if real else ()) if program_label(p.key) == label), None)
            la, gr = r["launch_ms"].get(label), r.get("graphed", {}).get(label)
            out.append(f"{label:>10} {n:>4} {ms:9.2f} {ms / n:9.3f} {'-' if la is None else f'{la:.3f}':>10} "
                       f"{'-' if dev is None else f'{dev:.3f}':>10} {'-' if not gr else f'{gr[0]:.3f}':>13} "
                       f"{'-' if not gr else f'{gr[1]:.3f}':>13}")
    return "\n".join(out)


ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
             "num_ooms")  # the caching allocator's counters whose rise in a step means cudaMalloc, frees or syncs


def allocator_delta(device: torch.device, run: Any) -> dict[str, int]:
    """What the caching allocator did while `run()` ran (CUDA only): each counter of ALLOCATOR, after less
    before. A retry frees every cached block (a device-wide sync); a device alloc or free is a cudaMalloc or
    cudaFree, which the steps of a warmed-up job should not need."""
    if device.type != "cuda":
        run()
        return {}
    before = torch.cuda.memory_stats(device)
    run()
    after = torch.cuda.memory_stats(device)
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in ALLOCATOR}


def barrier() -> None:
    """A barrier over the job (a world of one has no process group)."""
    if dist.is_initialized():
        dist.barrier()


def timed(step: Any, local: Any, batch: tuple, device: torch.device, n: int) -> float:
    times = []
    for _ in range(n):
        barrier()
        t = time.perf_counter()
        step(local, *batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_case(label: str, case: tuple, args: argparse.Namespace, world: Any, compiler: str) -> dict[str, Any]:
    fn, params, batch, extra = case
    t = time.perf_counter()
    step = engine.parallelize(fn, params, *batch, schedule=args.schedule, microbatches=args.microbatches,
                              compiler=compiler, calibrate=args.calibrate and f"{args.calibrate}/diag_{label}.json",
                              timeout=args.timeout, **extra)
    build_s = time.perf_counter() - t
    local = step.shard(params)
    if step.profile is None:  # parallelize measures the programs on CUDA only; here for against_programs too
        step.profile_programs(*batch)
    timed(step, local, batch, world.device, 3)
    timings: list[float] = []
    allocator = allocator_delta(world.device, lambda: timings.append(timed(step, local, batch, world.device,
                                                                             args.steps)))
    seconds = timings[0]
    again = remeasured(step, batch, world) if args.remeasure else None
    _, _, spans = step.traced(local, *batch)
    every = step.all_spans(spans)
    data, real = on_real_data(step, local, batch, every) if args.real else (None, None)
    host = step.transport.all_gather_json(host_costs(step, local, batch)) if args.host else None
    step.executor.capture = None
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"diag_{label}_{compiler}_rank{world.rank}.json"
    cuda = world.device.type == "cuda"
    barrier()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t = time.perf_counter()
        step(local, *batch)
        if cuda:
            torch.cuda.synchronize(world.device)
        wall = (time.perf_counter() - t) * 1e6
    prof.export_chrome_trace(str(path))
    stats = kernel_stats(path, wall) if cuda else {"wall_ms": wall / 1e3}
    stats["by_program"] = by_program(step, local, batch, out / f"diag_{label}_{compiler}_named_rank{world.rank}")
    stats["rank"] = world.rank
    stats["allocator"] = allocator
    stats["prog_compute_ms"] = program_compute_ms(step)
    gathered = step.transport.all_gather_json(stats)
    row = {"label": label, "compiler": compiler, "measured_s": seconds,
           "predicted_s": step.plan.predicted_step_time, "prog_s": step.predicted_step_time, "build_s": build_s,
           "ranks": gathered,
           "cuts": list(step.plan.cuts), "remeasured": again, "real_data": data, "host": host and host_table(host, real), "recompute": [str(r) for r in step.plan.recompute]}
    if world.rank == 0:
        print(step.plan, flush=True)
        print(report.compare(step, every), flush=True)
        print(report.against_programs(step, every), flush=True)
        print(report.beside_receives(step, every), flush=True)
        dump = {"spans": [attrs.asdict(x) for x in every], "table": [[str(a) for a in r] for r in step.table.rows],
                "profile": step.profile.to_json() if step.profile is not None else None,
                "measured_s": seconds, "prog_s": step.predicted_step_time}
        (out / f"spans_{label}_{compiler}_{args.schedule}.json").write_text(json.dumps(dump))
        print(json.dumps(row, indent=1), flush=True)
    step.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llama,gpt,resnet")
    ap.add_argument("--compilers", default="fx")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--calibrate", default=None, help="directory for calibration tables (none: uncalibrated)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--remeasure", action="store_true",
                    help="time the stage programs again after the timed steps (now / at start-up, per program)")
    ap.add_argument("--host", action="store_true",
                    help="where the host's time goes in a step, per program or instruction kind, beside each "
                         "program's launch time from idle (with --real) and its device time")
    ap.add_argument("--real", action="store_true",
                    help="time each program in turn on the operands a step gave it, beside its start-up time "
                         "(stand-ins) and its time in the step (is it the data?)")
    args = ap.parse_args()
    world = engine.init(timeout=args.timeout)
    tiny = args.tiny or world.device.type == "cpu"
    dtype = torch.float32 if tiny else torch.bfloat16
    rows = []
    for name in args.families.split(","):
        for compiler in args.compilers.split(","):
            if name == "resnet":
                case = resnet_case(tiny, args.microbatches, dtype, world.device)
            else:
                case = llm_case(name, "tiny" if tiny else "base", args.microbatches, 4, dtype, world.device)
            rows.append(run_case(name, case, args, world, compiler))
            del case
            if world.device.type == "cuda":
                torch.cuda.empty_cache()
    if world.rank == 0:
        print("\n| row | measured s | predicted s | m/p | from programs s | m/prog | rank | wall ms | compute ms "
              "(union) | kernels ms (sum) | programs ms | kernels / programs | nccl ms | idle ms | syncs |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            prog = r.get("prog_s")
            m_prog = f"{prog:.4f} | {r['measured_s'] / prog:.3f}" if prog else "- | -"
            for k in r["ranks"]:
                pc, ks = k.get("prog_compute_ms"), k.get("compute_sum_ms", 0.0)
                k_prog = f"{pc:.1f} | {ks / pc:.3f}" if pc else "- | -"
                print(f"| {r['label']} {r['compiler']} {args.schedule} | {r['measured_s']:.4f} | "
                      f"{r['predicted_s']:.4f} | {r['measured_s'] / r['predicted_s']:.3f} | {m_prog} | "
                      f"{k['rank']} | {k['wall_ms']:.1f} | {k.get('compute_ms', 0):.1f} | {ks:.1f} | {k_prog} | "
                      f"{k.get('nccl_ms', 0):.1f} | {k.get('idle_ms', 0):.1f} | {k.get('syncs', {})} |")
        for r in rows:
            for k in r["ranks"]:
                if k.get("by_program"):
                    print(f"\n{r['label']} {r['compiler']} rank {k['rank']}: each program's kernels in the step "
                          f"against the same program timed in turn\n{k['by_program']}")
        for r in rows:
            print(f"{r['label']} {r['compiler']}: the caching allocator over the {args.steps} timed steps, per rank: "
                  + "; ".join(f"{k['rank']}: {k.get('allocator', {})}" for k in r["ranks"]))
        for r in rows:
            if r.get("real_data"):
                print(f"\n{r['label']} {r['compiler']}: each program timed in turn on stand-ins (start-up), on the "
                      f"operands a step gave it (real data), and in the step\n{r['real_data']}")
        for r in rows:
            if r.get("host"):
                print(f"\n{r['label']} {r['compiler']}: the host's time in one step\n{r['host']}")
        for r in rows:
            if r.get("remeasured"):
                a = r["remeasured"]
                print(f"{r['label']} {r['compiler']}: the {a['n']} stage programs timed again after the steps: "
                      f"{a['median']:.3f} x their start-up seconds (median; {a['min']:.3f}-{a['max']:.3f})")
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
