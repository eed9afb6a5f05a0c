"""fnpipe against torch.distributed.pipelining, eager and compiled, on two model families, in one launch.

    # 2 GPUs: both families (GPT and Llama), every row below; one device command of at most 10 minutes
    PYTHONPATH=. torchrun --nproc_per_node 2 --master-port 29511 benchmarks/gpu_pipeline.py --budget 540
    # CPU smoke test (gloo, fp32, tiny sizes)
    PYTHONPATH=. torchrun --nproc_per_node 2 --master-port 29511 benchmarks/gpu_pipeline.py --tiny
    # one device (any world of 1, or --single): only the one-GPU rows
    PYTHONPATH=. python benchmarks/gpu_pipeline.py --single

    # the schedule library beside PyTorch's same-named schedules (p = 2; 4 with four GPUs), and schedule="auto"
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/gpu_pipeline.py --one-gpu-layers 0 --compilers auto \
        --schedules 1f1b,looped-bfs,interleaved-zb,zbv,dualpipev,auto --torch-eager 1f1b,looped-bfs,dualpipev \
        --torch-compiled 1f1b,looped-bfs --torch-risky interleaved-zb,zbv,dualpipev

Per family (`--families gpt,llama`; sizes in benchmarks/families.py: the 1 B GPT, the 0.85 B Llama):
  - PyTorch eager 1F1B, and PyTorch with each block `torch.compile`d (torchtitan's practice) for the
    schedules `--torch-compiled` (1f1b, gpipe, interleaved-1f1b);
  - fnpipe for `--schedules` (1f1b, zb-h1, interleaved-1f1b, zbv) with each of `--compilers` ("auto", the
    default: inductor on CUDA; and "fx"), each row with its predictions (the plan's step time, each rank's
    replayed peak), parallelize's seconds plus the first step's, and the compile seconds per stage;
  - on rank 0 alone, a model of `--one-gpu-layers` blocks: eager autograd (the nn.Module, loss.backward
    per microbatch), torch.func.grad, fnpipe one stage for each compiler; with `--one-gpu-paired N`, eager
    autograd and fnpipe's fx one stage again, side by side, N rounds of one step each (`step_timer.paired`).
Rows run in tiers across the families (`rows_of`): both baselines first, then fnpipe's default on 1f1b and
zb-h1, then fx there, then the rest; the budget (`--budget`, bench_guard.py) skips what no longer fits,
every rank alike, so the command ends in time with the rows that matter most. Last of the launch come the
PyTorch compiled schedules `--torch-risky` (zb-h1, zbv, interleaved-zb: zero-bubble with compiled blocks
hung on 2 x H200 in issue #15), each under a watchdog of `--risky-timeout` seconds: a hang is recorded in
the JSON and ends the launch (it is last, so nothing else is lost).
PyTorch's side (benchmarks/torch_pp_baseline.py, `SCHEDULES`): Schedule1F1B, ScheduleGPipe,
ScheduleInterleaved1F1B, ScheduleLoopedBFS, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV.

Batch 32 = 8 microbatches of 4. Prints progress, then per family the table and the targets; writes
`bench_<family>.json` under `--out-dir` (default $OUT, else out/) after every row.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import attrs
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from engine.execution.graphs import pool_bytes  # noqa: E402
from benchmarks import bench_report, torch_pp_baseline  # noqa: E402
from benchmarks.bench_guard import Guard  # noqa: E402
from benchmarks.families import Family, family, lm_loss  # noqa: E402
from benchmarks.step_timer import Measurement, measure, paired  # noqa: E402


class Bench:
    """One family's state in a launch: model, weights (host copy), batch, and its rows of results."""

    def __init__(self, args: argparse.Namespace, world: Any = None, fam: Family | None = None,
                 guard: Guard | None = None) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.world = world or engine.init(timeout=args.timeout)
        self.rank0 = self.world.rank == 0
        self.size = "tiny" if args.tiny else "large" if args.large else "base"
        self.fam = fam or family(args.families.split(",")[0], self.size)
        if fam is None and args.layers:
            self.fam = self.fam.with_layers(args.layers)
        self.config = self.fam.config
        self.guard = guard or Guard(args.budget, args.min_row, self.world.device, distributed=self.world.distributed)
        self.dtype = torch.float32 if args.tiny or self.world.device.type == "cpu" else torch.bfloat16
        self.m, self.batch = args.microbatches, args.microbatches * args.microbatch_size
        self.loss_fn = self.fam.loss_fn()
        self.params = self.weights(args.seed)
        self.tokens, self.targets = self.fam.batch(self.batch, seed=args.seed + 1)
        self.rows: list[dict[str, Any]] = []
        self.free()

    def weights(self, seed: int) -> Any:
        """The parameter tree on the host, identical on every rank: made on this rank's device, rank 0's copy
        broadcast, then kept on the host; each run copies what it needs to the device."""
        params = self.fam.params(self.dtype, self.world.device, seed)
        if self.world.distributed:
            for leaf in pytree.tree_leaves(params):
                dist.broadcast(leaf, src=0)
        return pytree.tree_map(lambda t: t.cpu(), params)

    def log(self, msg: str) -> None:
        if self.rank0:
            print(f"[{self.guard.elapsed():6.1f} s] {self.fam.name}: {msg}", flush=True)

    def free(self) -> None:
        gc.collect()
        if self.world.device.type == "cuda":
            torch.cuda.empty_cache()

    def sync_ranks(self) -> None:
        if self.world.distributed:
            dist.barrier()

    def measure(self, step_fn: Callable[[], Any], *, loss_of: Callable[[Any], float], label: str,
                across_ranks: bool = True, residue: int = 0) -> Measurement:
        return measure(step_fn, loss_of=loss_of, warmup=self.args.warmup, steps=self.args.steps,
                       device=self.world.device, across_ranks=across_ranks, label=label if self.rank0 else "",
                       residue=residue)

    def residue(self) -> int:
        """Bytes this rank holds before a row is built: what earlier rows left (a compiled module's weights
        kept by a cache, say), taken off the row's peak so each row counts only its own."""
        return torch.cuda.memory_allocated(self.world.device) if self.world.device.type == "cuda" else 0

    def add(self, framework: str, variant: str, schedule: str, result: Measurement, p: int, **extra: Any) -> None:
        dp = extra.get("dp", self.args.dp if framework == "fnpipe" else 1)
        v = extra.get("stages_per_rank", self.args.stages_per_rank)
        frac, formula = bench_report.bound(schedule, max(1, p // dp), self.m, v=v)
        row = {"framework": framework, "variant": variant, "schedule": schedule, "ranks": p, "bound": frac,
               "bound_formula": formula, "loss0": result.losses[0],
               "finite": all(math.isfinite(x) for x in result.losses), **result.to_json(), **extra}
        self.rows.append(row)
        self.log(f"{framework} {variant} {schedule}: {result.median:.4f} s/step, peak GiB "
                 f"{[bench_report.gib(b) for b in result.peak_bytes or []]}, loss {result.losses[0]:.4f}")

    def out_path(self) -> Path:
        base = Path(self.args.out_dir) if self.args.out_dir else bench_report.default_out().parent
        return base / f"bench_{self.fam.name}.json"

    def payload(self, **extra: Any) -> dict[str, Any]:
        flops = self.fam.flops(self.batch)
        p = self.world.size
        return {"family": self.fam.name, "config": self.size, "model": self.fam.describe(),
                "num_params": self.fam.num_params(), "dtype": str(self.dtype), "batch": self.batch,
                "microbatches": self.m, "microbatch_size": self.args.microbatch_size, "world_size": p,
                "device": device_name(self), "torch": torch.__version__, "flops": flops,
                "ideal_s": {"1": bench_report.ideal_seconds(flops["total"], 1),
                            str(p): bench_report.ideal_seconds(flops["total"], p)},
                "args": vars(self.args), "rows": self.rows, "elapsed_s": self.guard.elapsed(), **extra}

    def save(self, **extra: Any) -> None:
        if self.rank0:
            bench_report.write_json(self.out_path(), self.payload(**extra))


# -- the runs ------------------------------------------------------------------------------------------------
REBALANCE = {"": "auto", "fixed": False, "step": "step"}  # a compiler's suffix -> parallelize(rebalance=...)

@contextlib.contextmanager
def variant(modes: list[str]) -> Iterator[Any]:
    """A row's variant, from its compiler's suffixes (`--compilers auto-room8-gated`): "fixed" / "step" the
    rebalance mode (REBALANCE), "roomN" the extra stage-microbatches a searched zero-bubble order may hold
    (engine.planning.refine.ROOMS = (N,); "room0": none), "gated" gated receives (FNPIPE_GATED_RECV=1), "copy"
    copy-engine channels (FNPIPE_P2P=copy; both read when the transports are made, inside parallelize), "cold"
    the stage programs timed from a cold L2 cache (FNPIPE_PROFILE_COLD=1), "graphs" each compute replayed as a
    CUDA graph (FNPIPE_CUDA_GRAPHS=1), "cpp" inductor's C++ wrapper (FNPIPE_CPP_WRAPPER=1). Yields parallelize's
    `rebalance`."""
    from engine.planning import refine

    rebalance = REBALANCE[next((m for m in modes if m in REBALANCE), "")]
    rooms = [int(m[4:]) for m in modes if m.startswith("room")]
    switches = {"gated": ("FNPIPE_GATED_RECV", "1"), "copy": ("FNPIPE_P2P", "copy"), "cold": ("FNPIPE_PROFILE_COLD", "1"),
                "graphs": ("FNPIPE_CUDA_GRAPHS", "1"), "cpp": ("FNPIPE_CPP_WRAPPER", "1")}
    saved_rooms = refine.ROOMS
    saved = {name: os.environ.get(name) for name, _ in switches.values()}
    try:
        if rooms:
            refine.ROOMS = tuple(r for r in rooms if r > 0)
        for mode, (name, value) in switches.items():
            if mode in modes:
                os.environ[name] = value
        yield rebalance
    finally:
        refine.ROOMS = saved_rooms
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def waits_on_gpu(compilers: str) -> None:
    """Rows with streams that wait on the GPU (`-copy`, `-gated`) need CUDA_DEVICE_MAX_CONNECTIONS=32 from before
    CUDA starts (engine.execution.gates.queues_short); the switches themselves are set per row, after CUDA has
    started, so the launch sets it here, for every row of the launch alike (the NCCL rows beside them too)."""
    from engine.execution import gates

    modes = {m for c in compilers.split(",") for m in c.split("-")[1:]}
    if modes & {"copy", "gated"} and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(gates.QUEUES)


def run_torch(b: Bench, schedule: str, *, compiled: bool) -> None:
    b.log(f"torch.distributed.pipelining {schedule}{' compiled blocks' if compiled else ''}: building")
    residue = b.residue()
    res, info = torch_pp_baseline.run(b.config, b.params, b.tokens, b.targets, schedule=schedule, microbatches=b.m,
                                      device=b.world.device, dtype=b.dtype, dp=b.args.dp, v=b.args.stages_per_rank,
                                      family=b.fam, compile_blocks=compiled,
                                      measure=lambda fn, loss_of: b.measure(fn, loss_of=loss_of,
                                                                            label=f"torch {schedule}", residue=residue))
    if compiled:
        torch._dynamo.reset()  # its caches hold the compiled blocks (and their weights) past the row
    b.add("torch", "compiled" if compiled else "eager", schedule, res, b.world.size,
          to_first_step_s=info["build_s"] + (res.first_s or 0.0), **info)


def device_only(step: engine.Step) -> float | None:
    """The step predicted from its measured programs with no host modelled (their launches and the posts
    left out): what `step.predicted_step_time` was before the host track, to set beside it."""
    from engine.execution.profile import Profile, predicted_step_time
    if step.profile is None:
        return None
    bare = Profile(attrs.evolve(p, launch=None) for p in step.profile.programs)
    return predicted_step_time(step.plan, step.table, step.programs.all(), bare)


def predicted(step: engine.Step) -> dict[str, Any]:
    """fnpipe's predictions: the plan's step time, the step's from its measured programs, each rank's peak
    replayed from its program (with the measured programs' own bytes; no optimizer held here), the planner's
    memory model beside it (Adam state and margin included), and the stages. With CUDA graphs the replay has the
    graphs' pool and what they keep (`footprint._Graphed`), each also apart."""
    plan, memory = step.plan, step.memory()
    return {"predicted_s": plan.predicted_step_time, "program_predicted_s": step.predicted_step_time,
            "program_device_s": device_only(step), "posts_s": step.posts,
            "profile": [str(p) for p in step.profile.programs] if step.profile is not None else None,
            "against_plan": step.against_plan(),
            "predicted_bubble": plan.bubble_fraction,
            "predicted_peak_bytes": [f.peak for f in memory],
            "predicted_pool_bytes": [f.pool for f in memory], "predicted_kept_bytes": [f.kept for f in memory],
            "planner_peak_bytes_with_adam_and_margin": list(plan.rank_memory),
            "recompute": [("full" if r else "cheap" if c else "no") for r, c in zip(plan.recompute, plan.remat)],
            "stages": [{"index": s.index, "rank": s.rank, "eqns": [s.start, s.stop], "forward_s": s.forward_time,
                        "backward_s": s.backward_input_time + s.backward_weight_time, "params": s.num_params}
                       for s in plan.stages]}


predicted_peaks = predicted  # the name profile_stage.py and older scripts use


def calibration_path(b: Bench) -> str | bool:
    return str(Path(b.args.calibrate) / f"cal_{b.fam.name}.json") if b.args.calibrate else False


def alone_step(b: Bench, schedule: str, *, compiler: str = "fx", fused_recompute: bool | None = None) -> engine.Step:
    """fnpipe with one stage on this rank alone, inside a larger job (what parallelize does for world 1;
    `fused_recompute` None: as parallelize sets it, for an inductor-compiled step)."""
    from engine.execution.assemble import assemble
    from engine.execution.compilers import resolve
    from engine.execution.step import Step
    from engine.execution.transport import Hub, LocalTransport
    from engine.planning.artifacts import Workshop
    from engine.planning.search import search

    dev = b.world.device
    workshop = Workshop(b.loss_fn, b.params, (b.tokens, b.targets), device=dev.type)
    calibration = None
    if b.args.calibrate:  # rank 0 runs this alone: its own table
        from engine.parallelize import calibration as calibrate_on

        solo = engine.World(0, 1, 0, dev, False)
        table = calibrate_on(solo, workshop, calibration_path(b), microbatches=b.m, dp=1,
                             compiler=resolve(compiler, dev))
        calibration = table.for_compiler(resolve(compiler, dev))
    fused = resolve(compiler, dev) == "inductor" if fused_recompute is None else fused_recompute
    planned = search(b.loss_fn, b.params, b.tokens, b.targets, world_size=1, schedule=schedule, microbatches=b.m,
                     device=dev.type, calibration=calibration, workshop=workshop, fused_recompute=fused)
    step = Step(planned, engine.World(0, 1, 0, dev, False), LocalTransport(Hub(1, b.args.timeout), 0),
                compiler=compiler, program=assemble(planned, 0))
    step.verify()
    if dev.type == "cuda":
        step.profile_programs(b.tokens, b.targets)
    elif step.executor.compiler != "fx":
        step.executor.warmup(step.local_stages)
    return step


def run_fnpipe(b: Bench, schedule: str, *, compiler: str, alone: bool = False) -> None:
    b.log(f"fnpipe {schedule} compiler={compiler}{' (one stage)' if alone else ''}: planning")
    residue = b.residue()
    t = time.perf_counter()
    name, *modes = compiler.split("-")  # "auto-fixed": compiler auto, the planner's split kept (no rebalance)
    if alone:
        with variant(modes):
            step = alone_step(b, schedule, compiler=name)
    else:
        layout = {"dp": b.args.dp} if b.args.dp > 1 else {}
        if schedule in ("interleaved-1f1b", "looped-bfs", "interleaved-zb"):
            layout["stages_per_rank"] = b.args.stages_per_rank
        with variant(modes) as rebalance:
            step = engine.parallelize(b.loss_fn, b.params, b.tokens, b.targets, schedule=schedule, microbatches=b.m,
                                      timeout=b.args.timeout, calibrate=calibration_path(b), compiler=name,
                                      rebalance=rebalance, **layout)
    if step.profile is None:  # parallelize measures the programs on CUDA; the CPU smoke test does it here
        step.profile_programs(b.tokens, b.targets)
    build_s = time.perf_counter() - t
    if b.rank0:
        print(step.plan, flush=True)
        if step.rebalanced is not None:
            print(step.rebalanced, flush=True)
        predicted_ms = "n/a" if step.predicted_step_time is None else f"{step.predicted_step_time * 1e3:.2f} ms"
        print(f"stage programs measured before the first step (predicted step {predicted_ms} from them):\n"
              f"{step.profile}\nthe planner's stage times against them (ms a microbatch):\n{step.against_plan()}",
              flush=True)
    local = step.shard(b.params)
    x, y = b.tokens.to(b.world.device), b.targets.to(b.world.device)
    t = time.perf_counter()
    step(local, x, y)
    if b.world.device.type == "cuda":
        torch.cuda.synchronize(b.world.device)
    first_s = time.perf_counter() - t
    res = b.measure(lambda: step(local, x, y)[0], loss_of=float, label=f"fnpipe {schedule}/{compiler}",
                    across_ranks=not alone, residue=residue)
    graphs = step.executor.graphs
    if graphs is not None:  # the pool's bytes are the graphs' own, not in the allocator's count at replay
        b.log(f"fnpipe {schedule}/{compiler}: CUDA graphs {graphs.state}, {len(graphs.captured)} captured, pool "
              f"{pool_bytes(graphs) / 2**30:.2f} GiB on rank {b.world.rank}")
    b.add("fnpipe", f"{compiler}:{step.executor.compiler}", "1-stage" if alone else schedule, res,
          1 if alone else b.world.size, build_s=build_s, first_step_s=first_s, to_first_step_s=build_s + first_s,
          compile_s={str(k): v for k, v in step.compile_seconds.items()},
          setup_s={k: round(v, 2) for k, v in step.setup.seconds().items()},
          rebalanced=None if step.rebalanced is None else str(step.rebalanced), **predicted(step),
          **graph_memory(b, step, alone, lambda: step(local, x, y), residue, res.peak_bytes))
    step.close()
    del step, local


def graph_memory(b: Bench, step: engine.Step, alone: bool, one_step: Callable[[], Any], residue: int,
                 counted: Sequence[int] | None) -> dict[str, Any]:
    """With CUDA graphs, what a rank holds: the graphs' pool stays reserved between steps while the allocator
    counts none of it at replay, so the row's peak becomes pool + the allocator's peak over one more (replayed)
    step, less `residue` (earlier rows' bytes), or the allocator's count over the row where that is higher (the
    capture step); the allocator's own count stays beside it
    (`allocator_peak_bytes`). Also each rank's pool bytes and whether it replayed. A collective unless `alone`."""
    graphs = step.executor.graphs
    if graphs is None or b.world.device.type != "cuda":
        return {}
    dev = b.world.device
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    one_step()
    torch.cuda.synchronize(dev)
    pool = pool_bytes(graphs)
    mine = [float(pool), float(pool + torch.cuda.max_memory_allocated(dev) - residue),
            1.0 if graphs.state == "replay" else 0.0]
    if alone or not b.world.distributed:
        every = [mine]
    else:
        t = torch.tensor(mine, dtype=torch.float64, device=dev)
        parts = [torch.empty_like(t) for _ in range(b.world.size)]
        dist.all_gather(parts, t)
        every = [p.tolist() for p in parts]
    held = [int(r[1]) for r in every]
    if counted is not None:  # the capture step's own count, where it was higher
        held = [max(h, c) for h, c in zip(held, counted)]
    return {"graph_pool_bytes": [int(r[0]) for r in every], "peak_bytes": held,
            "allocator_peak_bytes": list(counted) if counted is not None else None,
            "graphs_replayed": [bool(r[2]) for r in every]}


def grad_step(b: Bench) -> Callable[[], torch.Tensor]:
    """Plain torch.func.grad of the same loss over the same microbatches, grads accumulated, one device."""
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


def eager_step(b: Bench) -> Callable[[], torch.Tensor]:
    """Eager autograd on the family's nn.Module: forward and loss.backward per microbatch, grads
    accumulated in .grad (what a plain PyTorch training loop does)."""
    dev, m = b.world.device, b.m
    model = b.fam.module(b.params, dev, b.dtype)
    xs, ys = b.tokens.to(dev).chunk(m), b.targets.to(dev).chunk(m)

    def one() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for x, y in zip(xs, ys):
            loss = lm_loss(model(x), y) / m
            loss.backward()
            total += loss.detach().float()
        return total

    return one


def one_device_rows(b: Bench) -> None:
    """Rank 0 alone, on a model of `--one-gpu-layers` blocks: eager autograd, torch.func.grad, fnpipe one
    stage per compiler. The other ranks wait at the barrier."""
    if b.rank0:
        wanted = _items(b.args.one_gpu_rows)
        rows = [("eager autograd", lambda: b.add("torch", "eager-autograd", "1-gpu",
                                                 b.measure(eager_step(b), loss_of=float, label="eager",
                                                           across_ranks=False), 1)) if "eager" in wanted else None,
                ("torch.func.grad", lambda: b.add("torch", "func.grad", "1-gpu",
                                                  b.measure(grad_step(b), loss_of=float, label="grad",
                                                            across_ranks=False), 1)) if "grad" in wanted else None,
                *[(f"fnpipe 1-stage {c}", lambda c=c: run_fnpipe(b, "1f1b", compiler=c, alone=True))
                  for c in _items(b.args.one_gpu_compilers or b.args.compilers)
                  if "fnpipe" in wanted and set(c.split("-")[1:]) <= {"graphs"}],  # one stage: no split to keep
                ("paired fx / eager", lambda: paired_rounds(b, b.args.one_gpu_paired))
                if b.args.one_gpu_paired and {"eager", "fnpipe"} <= set(wanted) else None]
        for label, run in [r for r in rows if r is not None]:
            if b.guard.elapsed() + b.args.min_row > b.guard.budget:  # rank 0 alone: its own clock decides
                b.rows.append({"framework": "skipped", "variant": label, "schedule": "1-gpu", "error": "out of budget"})
                continue
            guarded(b, label, run, collective=False)
    b.sync_ranks()


def paired_rounds(b: Bench, rounds: int) -> None:
    """Eager autograd and fnpipe's one stage (fx) built side by side and their steps alternated (`paired`): the
    one-stage goal's ratio at one host pace, where the rows above each met whatever pace their minutes had."""
    eager = eager_step(b)
    step = alone_step(b, "1f1b", compiler="fx")
    try:
        local = step.shard(b.params)
        x, y = b.tokens.to(b.world.device), b.targets.to(b.world.device)
        eager_s, fnpipe_s = paired(eager, lambda: step(local, x, y)[0], rounds=rounds, device=b.world.device)
    finally:
        step.close()
    ratios = [f / e for f, e in zip(fnpipe_s, eager_s)]
    median = statistics.median(ratios)
    b.rows.append({"framework": "paired", "variant": "fx/eager-autograd", "schedule": "1-gpu-paired",
                   "rounds": rounds, "eager_s": eager_s, "fnpipe_s": fnpipe_s, "median_ratio": median})
    b.log(f"paired rounds: eager {min(eager_s):.4f}-{max(eager_s):.4f} s, fnpipe fx {min(fnpipe_s):.4f}-"
          f"{max(fnpipe_s):.4f} s, fx / eager per round {min(ratios):.3f}-{max(ratios):.3f}, median {median:.3f}")


def guarded(b: Bench, label: str, run: Callable[[], None], *, collective: bool = True,
            timeout: float | None = None) -> None:
    """One row: skipped when the budget has no room (all ranks alike), watched for hangs, an error recorded
    as a row and the launch goes on; the JSON is rewritten after it, so partial results survive."""
    compiles = "compiled" in label or label.endswith((" auto", " inductor"))  # a compile: about twice a row
    if collective and not b.guard.room(b.args.min_row * (2 if compiles else 1)):
        b.rows.append({"framework": "skipped", "variant": label, "schedule": "-", "error": "out of budget"})
        b.log(f"{label}: skipped (out of budget)")
        return
    b.save(running=label)  # if the launch is killed inside this row, its JSON says where

    def hung() -> None:
        b.rows.append({"framework": "hung", "variant": label, "schedule": "-",
                       "error": f"still running after {timeout or b.args.row_timeout:.0f} s: ended the launch"})
        print(f"rank {b.world.rank}: {label} HUNG; ending the launch", flush=True)
        b.save()

    try:
        b.guard.watched(timeout or b.args.row_timeout, hung, run)
    except Exception as exc:  # noqa: BLE001 -- reported in the table and the JSON
        b.rows.append({"framework": "failed", "variant": label, "schedule": "-", "error": f"{type(exc).__name__}: {exc}"})
        print(f"rank {b.world.rank}: {label} FAILED: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    b.free()
    b.save()


def finish(b: Bench) -> None:
    """The family's table and targets, printed by rank 0, and its JSON."""
    if not b.rank0:
        return
    flops = b.fam.flops(b.batch)
    print(f"\n== {b.fam.describe()}, {str(b.dtype).replace('torch.', '')}, {b.fam.num_params() / 1e9:.3f} B params; "
          f"batch {b.batch} = {b.m} x {b.args.microbatch_size}; {b.world.size} x {device_name(b)}; torch "
          f"{torch.__version__}; FLOPs/step {flops['total']:.4g}")
    for r in b.rows:
        if "error" in r:
            print(f"{r['framework'].upper()} {r['variant']} {r['schedule']}: {r['error']}")
    print("\n" + bench_report.format_table(b.rows) + "\n\n" + bench_report.LEGEND + "\n", flush=True)
    print("\n".join(bench_report.targets(b.rows)), flush=True)
    b.save()
    print(f"wrote {b.out_path()}", flush=True)


def device_name(b: Bench) -> str:
    return torch.cuda.get_device_name(b.world.device) if b.world.device.type == "cuda" else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="CPU smoke sizes (d=64, 2 blocks, seq 32, fp32)")
    size.add_argument("--large", action="store_true", help="the GPT's 24 blocks, d=2560 (the Llama stays 0.85 B)")
    ap.add_argument("--families", default="gpt,llama", help="model families, comma separated: gpt, llama")
    ap.add_argument("--single", action="store_true", help="only the one-device rows")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--schedules", default="1f1b,zb-h1,interleaved-1f1b,zbv", help="fnpipe schedules")
    ap.add_argument("--compilers", default="auto,fx", help="fnpipe compilers: auto (inductor on CUDA), fx, inductor; "
                    "with -fixed (auto-fixed): the planner's split kept, parallelize(rebalance=False); with -step "
                    "(auto-step): re-split from the programs' times inside traced steps, rebalance=\"step\"; with -roomN "
                    "(auto-room2): a searched zero-bubble order holds at most N stage-microbatches more (refine.ROOMS); "
                    "with -gated: gated receives (FNPIPE_GATED_RECV=1); with -copy: copy-engine channels (FNPIPE_P2P=copy); "
                    "with -cold: programs timed from a cold L2 cache (FNPIPE_PROFILE_COLD=1); "
                    "with -graphs: each compute replayed as a CUDA graph (FNPIPE_CUDA_GRAPHS=1); "
                    "suffixes combine (auto-room8-gated)")
    ap.add_argument("--torch-eager", default="1f1b", help="PyTorch schedules with eager blocks")
    ap.add_argument("--torch-compiled", default="1f1b,gpipe,interleaved-1f1b",
                    help="PyTorch schedules with each block torch.compile'd (run in each family's part)")
    ap.add_argument("--torch-risky", default="zb-h1,zbv,interleaved-zb", help="PyTorch compiled schedules run "
                    "last of the launch under --risky-timeout (a hang ends the launch)")
    ap.add_argument("--risky-timeout", type=float, default=75.0)
    ap.add_argument("--row-timeout", type=float, default=300.0, help="seconds any one row may take")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole launch: rows that would "
                    "start with less than --min-row left are skipped")
    ap.add_argument("--min-row", type=float, default=40.0)
    ap.add_argument("--one-gpu-layers", type=int, default=8, help="blocks of the one-device rows' model (0: skip)")
    ap.add_argument("--one-gpu-compilers", default="", help="the one-device fnpipe rows' compilers (empty: "
                    "--compilers')")
    ap.add_argument("--one-gpu-rows", default="eager,grad,fnpipe", help="which one-device rows: eager autograd, "
                    "torch.func.grad, fnpipe one stage (per compiler)")
    ap.add_argument("--one-gpu-paired", type=int, default=0, help="rounds of eager autograd and fnpipe's one "
                    "stage (fx) alternated, one step each (0: none): the one-stage ratio at one host pace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (world = stages x dp)")
    ap.add_argument("--stages-per-rank", type=int, default=2, help="v of the interleaved schedules")
    ap.add_argument("--layers", type=int, default=None, help="override the block count")
    ap.add_argument("--calibrate", default=None, help="directory of the calibration tables (cal_<family>.json): "
                    "rank 0 times the model's ops (and, for compiled rows, its compiled programs) once")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds any collective may wait")
    ap.add_argument("--out-dir", default=None, help="where bench_<family>.json go (default $OUT, else out/)")
    return ap.parse_args(argv)


def _items(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


Row = tuple[int, Bench, str, Callable[[], None], "float | None"]  # (tier, bench, label, run, timeout)


def rows_of(b: Bench) -> list[Row]:
    """One family's pipelined rows with their tiers: what matters most runs first, in every family, before
    anything of the next tier (the budget may end the launch early): 0 PyTorch 1F1B eager and compiled;
    1 fnpipe's first compiler (the default, auto) on the first two schedules; 2 the second compiler there;
    3 the other schedules, both frameworks; 5 PyTorch's risky compiled schedules, under their watchdog."""
    a = b.args
    if b.world.size == 1 or a.single:
        return []
    compiled, compilers, scheds = _items(a.torch_compiled), _items(a.compilers), _items(a.schedules)
    out: list[Row] = [(0, b, f"torch eager {s}", lambda s=s: run_torch(b, s, compiled=False), None)
                      for s in _items(a.torch_eager)]
    out += [(0 if k == 0 else 3, b, f"torch compiled {s}", lambda s=s: run_torch(b, s, compiled=True), None)
            for k, s in enumerate(compiled)]
    out += [(1 + min(i, 1) if j < 2 else 3, b, f"fnpipe {s} {c}", lambda s=s, c=c: run_fnpipe(b, s, compiler=c), None)
            for i, c in enumerate(compilers) for j, s in enumerate(scheds)]
    out += [(5, b, f"torch compiled {s}", lambda s=s: run_torch(b, s, compiled=True), a.risky_timeout)
            for s in _items(a.torch_risky)]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    waits_on_gpu(args.compilers)
    world = engine.init(timeout=args.timeout)
    guard = Guard(args.budget, args.min_row, world.device, distributed=world.distributed)
    size = "tiny" if args.tiny else "large" if args.large else "base"
    fams = [family(name, size) for name in _items(args.families)]
    benches = [Bench(args, world, f.with_layers(args.layers) if args.layers else f, guard) for f in fams]
    for b in benches:
        b.log(f"world {world.size} on {device_name(b)}, {b.fam.describe()}, {b.fam.num_params() / 1e9:.3f} B params")
    rows = sorted((r for b in benches for r in rows_of(b)), key=lambda r: r[0])  # stable: family order kept
    for _, b, label, run, timeout in (r for r in rows if r[0] < 5):
        guarded(b, label, run, timeout=timeout)
    for b in benches:
        finish(b)
    one_gpu(args, world, benches, guard)
    risky = [r for r in rows if r[0] == 5]  # last: a hang here ends the launch and loses nothing else
    for _, b, label, run, timeout in risky:
        guarded(b, label, run, timeout=timeout)
    if risky and world.rank == 0:
        for b in benches:
            print("\n" + bench_report.summary(b.payload()), flush=True)
    if world.rank == 0:
        print(f"done in {guard.elapsed():.0f} s", flush=True)
    if world.distributed:
        dist.barrier()
        dist.destroy_process_group()


def one_gpu(args: argparse.Namespace, world: Any, benches: list[Bench], guard: Guard) -> None:
    """The one-device rows of every family (rank 0; a model of --one-gpu-layers blocks), then its table."""
    if not args.one_gpu_layers:
        return
    for b in benches:
        solo = Bench(args, world, b.fam.with_layers(min(args.one_gpu_layers, b.fam.n_layers)), guard)
        one_device_rows(solo)
        b.rows += [{**r, "one_gpu_layers": solo.fam.n_layers} for r in solo.rows]
        del solo
        b.free()
        if b.rank0:
            b.save()
            print(f"\n== {b.fam.name}, one device, {min(args.one_gpu_layers, b.fam.n_layers)} blocks")
            print(bench_report.format_table([r for r in b.rows if r["schedule"] in ("1-gpu", "1-stage")]))
            print("\n".join(t for t in bench_report.targets(b.rows) if "one stage" in t), flush=True)


if __name__ == "__main__":
    main()
