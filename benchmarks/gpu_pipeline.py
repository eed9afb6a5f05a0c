"""fnpipe against torch.distributed.pipelining on one GPT, same weights and batch, in one launch.

    # 2 GPUs (preferred): PyTorch Schedule1F1B + ScheduleGPipe (even hand split), fnpipe gpipe / 1f1b /
    # zb-h1 / zbv (automatic split), then on rank 0 alone plain torch.func.grad and fnpipe with one stage
    PYTHONPATH=. torchrun --nproc_per_node 2 --master-port 29511 benchmarks/gpu_pipeline.py [--large]
    PYTHONPATH=. mpirun -n 2 python benchmarks/gpu_pipeline.py [--large]
    # one GPU only: torch.func.grad against fnpipe with one stage ("--single" or any world of 1)
    PYTHONPATH=. python benchmarks/gpu_pipeline.py --single [--large]
    # 4 GPUs: depth 4 (PyTorch 1F1B, GPipe, Interleaved1F1B, ZBV against fnpipe's five schedules), then
    # DP2 x PP2 (PyTorch's stages wrapped in DDP over the replicas; fnpipe with dp=2)
    PYTHONPATH=. torchrun --nproc_per_node 4 benchmarks/gpu_pipeline.py --schedules gpipe,1f1b,interleaved-1f1b,zb-h1,zbv \
        --torch-schedules 1f1b,gpipe,interleaved-1f1b,zbv
    PYTHONPATH=. torchrun --nproc_per_node 4 benchmarks/gpu_pipeline.py --dp 2 --no-one-gpu
    # CPU smoke test (gloo, fp32, d=64, 2 blocks, seq 32; --layers 8 for 8 stages)
    PYTHONPATH=. torchrun --nproc_per_node 2 --master-port 29511 benchmarks/gpu_pipeline.py --tiny
    # the schedule library side by side with PyTorch's same-named schedules (p = 2; 4 with four GPUs), and
    # schedule="auto" (the planner's pick, its candidates printed with the plan)
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/gpu_pipeline.py --no-one-gpu \
        --schedules looped-bfs,interleaved-zb,zbv,dualpipev,auto --torch-schedules looped-bfs,interleaved-zb,zbv,dualpipev

PyTorch's side (benchmarks/torch_pp_baseline.py): Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV with an even hand split of the blocks, its documented
practice; with --dp its stages are wrapped in DDP (the zero-bubble ones all-reduce by hand: their
backward bypasses DDP's hooks).

Model: examples.gpt_model with an untied head (PyTorch's pipelining cannot tie across stages); base
16 blocks, d=2048, 16 heads of 128, seq 1024, vocab 50304, bf16; `--large` 24 blocks, d=2560 (20 heads).
Batch 32 = 8 microbatches of 4. Prints progress, then the table; writes everything to `--out`
(default $OUT/bench.json, else out/bench.json). What the columns mean: bench_report.LEGEND.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from benchmarks import bench_report, torch_pp_baseline  # noqa: E402
from benchmarks.step_timer import Measurement, measure  # noqa: E402
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn  # noqa: E402

CONFIGS = {
    "base": GPTConfig(vocab_size=50304, seq_len=1024, d_model=2048, n_layers=16, head_dim=128, tied=False),
    "large": GPTConfig(vocab_size=50304, seq_len=1024, d_model=2560, n_layers=24, head_dim=128, tied=False),
    "tiny": GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_layers=2, head_dim=16, tied=False),
}
REFERENCE = {"note": "DESIGN.md, 2xH200, base config: torch.distributed.pipelining", "torch_1f1b_s": 0.189,
             "torch_1f1b_peak_gib": [6.1, 4.5], "torch_gpipe_s": 0.190, "torch_gpipe_peak_gib": [18.1, 18.8],
             "one_gpu_s": 0.345}


class Bench:
    """The shared state of one launch: world, model, weights (host copy), batch, rows of results."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.world = engine.init(timeout=args.timeout)
        self.rank0 = self.world.rank == 0
        self.name = "tiny" if args.tiny else "large" if args.large else "base"
        self.config = CONFIGS[self.name]
        if args.layers:
            self.config = attrs.evolve(self.config, n_layers=args.layers)
        self.dtype = torch.float32 if args.tiny or self.world.device.type == "cpu" else torch.bfloat16
        self.m, self.batch = args.microbatches, args.microbatches * args.microbatch_size
        self.loss_fn = make_loss_fn(self.config)
        self.params = self.weights(args.seed)
        self.tokens, self.targets = example_batch(self.config, self.batch, seed=args.seed + 1)
        self.rows: list[dict[str, Any]] = []
        self.free()

    def weights(self, seed: int) -> Any:
        """The parameter tree on the host, identical on every rank: made on this rank's device (fast), rank
        0's copy broadcast (so ranks agree even if their generators did not), then kept on the host; each
        run copies what it needs to the device."""
        params = init_params(self.config, self.dtype, self.world.device, seed=seed)
        if self.world.distributed:
            for leaf in pytree.tree_leaves(params):
                dist.broadcast(leaf, src=0)
        return pytree.tree_map(lambda t: t.cpu(), params)

    def log(self, msg: str) -> None:
        if self.rank0:
            print(f"[{time.perf_counter() - self.t0:6.1f} s] {msg}", flush=True)

    def free(self) -> None:
        gc.collect()
        if self.world.device.type == "cuda":
            torch.cuda.empty_cache()

    def sync_ranks(self) -> None:
        if self.world.distributed:
            dist.barrier()

    def measure(self, step_fn: Callable[[], Any], *, loss_of: Callable[[Any], float], label: str,
                across_ranks: bool = True) -> Measurement:
        return measure(step_fn, loss_of=loss_of, warmup=self.args.warmup, steps=self.args.steps,
                       device=self.world.device, across_ranks=across_ranks, label=label if self.rank0 else "")

    def add(self, framework: str, schedule: str, result: Measurement, p: int, **extra: Any) -> None:
        """Record a row; the bound uses the row's own dp and stages_per_rank (PyTorch rows carry them),
        else fnpipe's --dp / --stages-per-rank for fnpipe rows and dp 1 for the one-device rows."""
        dp = extra.get("dp", self.args.dp if framework == "fnpipe" else 1)
        v = extra.get("stages_per_rank", self.args.stages_per_rank)
        frac, formula = bench_report.bound(schedule.split("+")[0], max(1, p // dp), self.m, v=v)
        row = {"framework": framework, "schedule": schedule, "ranks": p, "bound": frac, "bound_formula": formula,
               "loss0": result.losses[0], "finite": all(math.isfinite(x) for x in result.losses),
               **result.to_json(), **extra}
        self.rows.append(row)
        self.log(f"{framework} {schedule}: {result.median:.4f} s/step, peak GiB "
                 f"{[bench_report.gib(b) for b in result.peak_bytes or []]}, loss {result.losses[0]:.4f} -> "
                 f"{result.losses[-1]:.4f}")


# -- the runs ------------------------------------------------------------------------------------------------
def run_torch(b: Bench, schedule: str) -> None:
    dp = b.args.dp if b.args.torch_dp is None else b.args.torch_dp
    b.log(f"torch.distributed.pipelining {schedule} (dp {dp}): building the stages")
    res, info = torch_pp_baseline.run(b.config, b.params, b.tokens, b.targets, schedule=schedule, microbatches=b.m,
                                      device=b.world.device, dtype=b.dtype, dp=dp, v=b.args.stages_per_rank,
                                      first_blocks=b.args.torch_first_blocks,
                                      measure=lambda fn, loss_of: b.measure(fn, loss_of=loss_of,
                                                                            label=f"torch {schedule}"))
    b.add("torch", schedule, res, b.world.size, **info)
    b.free()


def predicted_peaks(step: engine.Step) -> dict[str, Any]:
    """fnpipe's predictions: the step time (the planner's simulation) and each rank's peak bytes replayed
    from its program (`step.memory()`: params, grads, buffers, temporaries; no optimizer is held here),
    with the planner's memory model beside it (Adam state and its 10 % margin included, as it plans)."""
    plan = step.plan
    return {"predicted_s": plan.predicted_step_time, "predicted_bubble": plan.bubble_fraction,
            "predicted_peak_bytes": [f.peak for f in step.memory()],
            "planner_peak_bytes_with_adam_and_margin": list(plan.rank_memory),
            "stages": [{"index": s.index, "rank": s.rank, "eqns": [s.start, s.stop], "forward_s": s.forward_time,
                        "backward_s": s.backward_input_time + s.backward_weight_time, "params": s.num_params}
                       for s in plan.stages]}


def alone_step(b: Bench, schedule: str, *, compiler: str = "fx") -> engine.Step:
    """fnpipe with one stage on this rank alone, inside a larger job (what parallelize does for world 1)."""
    from engine.execution.assemble import assemble
    from engine.execution.step import Step
    from engine.execution.transport import Hub, LocalTransport
    from engine.planning.artifacts import Workshop
    from engine.planning.search import search

    dev = b.world.device
    workshop = Workshop(b.loss_fn, b.params, (b.tokens, b.targets), device=dev.type)
    calibration = None
    if b.args.calibrate:  # the table the pipelined runs loaded or made (rank 0 runs this alone)
        from engine.parallelize import calibration as calibrate_on

        calibration = calibrate_on(engine.World(0, 1, 0, dev, False), workshop, b.args.calibrate, microbatches=b.m,
                                   dp=1)
    planned = search(b.loss_fn, b.params, b.tokens, b.targets, world_size=1, schedule=schedule, microbatches=b.m,
                     device=dev.type, calibration=calibration, workshop=workshop)
    step = Step(planned, engine.World(0, 1, 0, dev, False), LocalTransport(Hub(1, b.args.timeout), 0),
                compiler=compiler, program=assemble(planned, 0))
    step.verify()
    return step


def run_fnpipe(b: Bench, schedule: str, *, alone: bool = False, compiler: str = "fx") -> None:
    label = schedule + ("+inductor" if compiler == "inductor" else "")
    b.log(f"fnpipe {label}{' (one stage)' if alone else ''}: planning")
    t = time.perf_counter()
    if alone and b.world.size > 1:
        step = alone_step(b, schedule, compiler=compiler)
    else:
        layout = {"dp": b.args.dp} if b.args.dp > 1 else {}
        if schedule in ("interleaved-1f1b", "looped-bfs", "interleaved-zb"):
            layout["stages_per_rank"] = b.args.stages_per_rank
        step = engine.parallelize(b.loss_fn, b.params, b.tokens, b.targets, schedule=schedule, microbatches=b.m,
                                  timeout=b.args.timeout, calibrate=b.args.calibrate or False, compiler=compiler,
                                  **layout)
    build_s = time.perf_counter() - t
    if b.rank0:
        print(step.plan, flush=True)
    local = step.shard(b.params)
    x, y = b.tokens.to(b.world.device), b.targets.to(b.world.device)
    res = b.measure(lambda: step(local, x, y)[0], loss_of=float, label=f"fnpipe {label}", across_ranks=not alone)
    p = 1 if alone else b.world.size
    b.add("fnpipe", label if not alone else "1-stage", res, p, build_s=build_s, compiler=compiler,
          **predicted_peaks(step))
    del step, local
    b.free()


def grad_step(b: Bench) -> Callable[[], torch.Tensor]:
    """Plain torch.func.grad of the same loss over the same microbatches, grads accumulated, one device:
    a step function returning the summed loss."""
    dev, m = b.world.device, b.m
    params = pytree.tree_map(lambda t: t.to(dev), b.params)
    fn = torch.func.grad_and_value(lambda p, x, y: b.loss_fn(p, x, y) / m)
    xs, ys = b.tokens.to(dev).chunk(m), b.targets.to(dev).chunk(m)

    def one() -> torch.Tensor:
        acc, total = None, torch.zeros((), device=dev)
        for x, y in zip(xs, ys):
            g, loss = fn(params, x, y)
            leaves = pytree.tree_leaves(g)
            if acc is None:
                acc = leaves
            else:
                torch._foreach_add_(acc, leaves)
            total += loss.detach().float()
        return total

    return one


def run_grad(b: Bench) -> None:
    b.log("plain torch.func.grad on one device")
    b.add("torch", "grad", b.measure(grad_step(b), loss_of=float, label="torch.func.grad", across_ranks=False), 1)
    b.free()


# -- the launch ----------------------------------------------------------------------------------------------
def one_device_runs(b: Bench) -> None:
    """torch.func.grad and fnpipe with one stage on rank 0; the other ranks wait."""
    if b.rank0:
        guarded(b, "torch grad", lambda: run_grad(b))
        if not b.args.no_fnpipe:
            guarded(b, "fnpipe 1-stage", lambda: run_fnpipe(b, "1f1b", alone=True))
    b.sync_ranks()


def guarded(b: Bench, label: str, run: Callable[[], None]) -> None:
    """Run one measurement; an error is recorded as a row and the launch goes on (a rank left waiting in
    a collective ends at --timeout). The JSON is rewritten after every run, so partial results survive."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 -- reported in the table and the JSON
        b.rows.append({"framework": label.split()[0], "schedule": label.split()[-1], "error": f"{type(exc).__name__}: {exc}"})
        print(f"rank {b.world.rank}: {label} FAILED: {type(exc).__name__}: {exc}", flush=True)
        b.free()
    if b.rank0:
        bench_report.write_json(out_path(b), payload(b))


def out_path(b: Bench) -> Path:
    return Path(b.args.out) if b.args.out else bench_report.default_out()


def payload(b: Bench) -> dict[str, Any]:
    flops = bench_report.model_flops(b.config, b.batch)
    p = b.world.size
    return {
        "config": b.name, "model": {**vars_of(b.config), "n_heads": b.config.n_heads,
                                    "num_params": b.config.num_params()},
        "dtype": str(b.dtype), "batch": b.batch, "microbatches": b.m, "microbatch_size": b.args.microbatch_size,
        "world_size": p, "device": device_name(b), "torch": torch.__version__, "flops": flops,
        "ideal_s": {"1": bench_report.ideal_seconds(flops["total"], 1), str(p): bench_report.ideal_seconds(flops["total"], p)},
        "reference": REFERENCE, "args": vars(b.args), "rows": b.rows, "elapsed_s": time.perf_counter() - b.t0}


def finish(b: Bench) -> None:
    one_gpu = next((r["median_s"] for r in b.rows if r["schedule"] == "grad" and "median_s" in r), None)
    for r in (r for r in b.rows if "median_s" in r):
        r["bound_s"] = one_gpu / (r["ranks"] * r["bound"]) if one_gpu else None
        r["efficiency"] = one_gpu / (r["ranks"] * r["median_s"]) if one_gpu else None
    flops = bench_report.model_flops(b.config, b.batch)
    p = b.world.size
    done = [r for r in b.rows if "median_s" in r]
    losses = {f"{r['framework']} {r['schedule']}": r["loss0"] for r in done}
    spread = max(losses.values()) - min(losses.values()) if losses else 0.0
    print(f"\n== {b.name} GPT: {b.config.n_layers} blocks, d={b.config.d_model}, {b.config.n_heads} heads, seq "
          f"{b.config.seq_len}, vocab {b.config.vocab_size}, untied head, {str(b.dtype).replace('torch.', '')}; "
          f"batch {b.batch} = {b.m} x {b.args.microbatch_size}; {p} x {device_name(b)}; torch {torch.__version__}")
    print(f"FLOPs/step {flops['total']:.4g} (causal attention; {flops['total_full_attention']:.4g} "
          f"counting it full); ideal at {bench_report.H200_BF16_FLOPS / 1e12:.0f} TFLOP/s: "
          f"1 GPU {bench_report.ideal_seconds(flops['total'], 1):.4g} s, {p} GPUs "
          f"{bench_report.ideal_seconds(flops['total'], p):.4g} s")
    print(f"initial losses: " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items()) + f" (spread {spread:.2e})")
    bad = [k for k, r in zip(losses, done) if not r["finite"]]
    if bad:
        print(f"NON-FINITE LOSS in: {bad}")
    for r in b.rows:
        if "error" in r:
            print(f"FAILED {r['framework']} {r['schedule']}: {r['error']}")
    print("\n" + bench_report.format_table(b.rows) + "\n\n" + bench_report.LEGEND + "\n", flush=True)
    print("\n".join(bench_report.targets(b.rows)), flush=True)
    out = out_path(b)
    bench_report.write_json(out, {**payload(b), "initial_loss_spread": spread})
    print(f"wrote {out} ({time.perf_counter() - b.t0:.0f} s in all)", flush=True)


def vars_of(config: GPTConfig) -> dict[str, Any]:
    return attrs.asdict(config)


def device_name(b: Bench) -> str:
    return torch.cuda.get_device_name(b.world.device) if b.world.device.type == "cuda" else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="CPU smoke size: d=64, 2 blocks, seq 32, fp32")
    size.add_argument("--large", action="store_true", help="24 blocks, d=2560 instead of 16 blocks, d=2048")
    ap.add_argument("--single", action="store_true", help="one device only: torch.func.grad vs fnpipe one stage")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--schedules", default="gpipe,1f1b,zb-h1,zbv", help="fnpipe schedules, comma separated")
    ap.add_argument("--inductor", default="", help="fnpipe schedules to run again with compiler='inductor' "
                    "(stage programs compiled by torch.compile), comma separated")
    ap.add_argument("--torch-schedules", default="1f1b,gpipe", help="PyTorch schedules, comma separated: "
                    + ", ".join(torch_pp_baseline.SCHEDULES))
    ap.add_argument("--torch-first-blocks", type=int, default=None, help="blocks on PyTorch's first stage "
                    "when it has 2 stages (default: half)")
    ap.add_argument("--torch-dp", type=int, default=None, help="PyTorch's data-parallel replicas (default: --dp)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    ap.add_argument("--no-fnpipe", action="store_true", help="skip fnpipe")
    ap.add_argument("--no-one-gpu", action="store_true", help="skip the one-device runs in a multi-rank launch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", type=int, default=1, help="fnpipe data-parallel replicas (world = stages x dp)")
    ap.add_argument("--stages-per-rank", type=int, default=2, help="v for interleaved-1f1b (fnpipe and PyTorch) "
                    "and PyTorch's interleaved-zb")
    ap.add_argument("--layers", type=int, default=None, help="override the config's block count (e.g. --tiny "
                    "--layers 8 for 8 stages)")
    ap.add_argument("--calibrate", default=None, help="JSON path: time the model's ops once on rank 0 (kept "
                    "there for the other schedules) so fnpipe splits by measured costs")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds any collective may wait")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench.json, else out/bench.json)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    b = Bench(parse_args(argv))
    args, world = b.args, b.world
    b.log(f"world {world.size} on {device_name(b)}, {b.name} config, {b.config.num_params() / 1e9:.3f} B params")
    if world.size > 1 and not args.single:
        for s in [] if args.no_torch else [x for x in args.torch_schedules.split(",") if x]:
            guarded(b, f"torch {s}", lambda: run_torch(b, s))
            b.sync_ranks()
        for s in [] if args.no_fnpipe else [x for x in args.schedules.split(",") if x]:
            guarded(b, f"fnpipe {s}", lambda: run_fnpipe(b, s))
            b.sync_ranks()
    if world.size == 1 or args.single or not args.no_one_gpu:
        one_device_runs(b)
    if world.size > 1 and not args.single:  # last: a compile per stage program, minutes
        for s in [] if args.no_fnpipe else [x for x in args.inductor.split(",") if x]:
            guarded(b, f"fnpipe {s}+inductor", lambda: run_fnpipe(b, s, compiler="inductor"))
            b.sync_ranks()
    if b.rank0:
        finish(b)
    b.sync_ranks()
    if world.distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
