"""schedule="auto" against every fixed schedule: predicted step times, auto's rank, planning time, measured CPU steps.

    PYTHONPATH=. python benchmarks/auto_schedule.py [--models gpt,llama,resnet] [--worlds 2,4] [--device cpu]
    mpirun -n 2 python benchmarks/auto_schedule.py --measure [--models gpt] [--steps 5] [--runs 3] [--schedules zbv,...]

Planning (one process, nothing allocated: meta weights): for each small model x world x memory ("roomy": the
device's memory; "tight": half the peak per rank of the roomy auto plan, so schedules that hold more
microbatches or the layouts that fit change), `engine.plan(schedule="auto")` with stages, dp and microbatches
"auto". A row prints each fixed schedule's predicted step (ms; "-" where it does not fit) as auto considered it
(`plan.considered`: the same search as `engine.plan(schedule=name)`, sharing one trace; `--independent` plans
every fixed schedule on its own as well and notes any difference), auto's pick, its layout and rank among the
fixed ones (1 = the best prediction; "~" marks an estimate: auto did not make that schedule exact, its best
estimate being 25 % past the best), and the planning seconds of auto against "1f1b" planned on its own (each
after a warm-up plan of the model, with no zero-bubble order cached from an earlier plan).

Measuring (`--measure`, under mpirun, gloo on CPU, float32): world = the launch's size, roomy memory, dp = 1
(a pipeline: with dp "auto" these small models plan as pure data parallelism, where every schedule is the
same step), `engine.parallelize` of auto and of every fixed schedule that fits, each timed in `--runs` rounds
of `--steps` steps (schedules taken in turn each round, so drift hits all alike); a schedule's time is the
least of its rounds' medians. Rank 0 prints measured against predicted, and auto / the fastest fixed schedule
measured. The models are tiny on purpose (a step takes a fraction of a second on two shared CPU cores): the
CPU cost model (roofline of a nominal CPU) ranks schedules by bubbles and memory as the GPU one does, but its
absolute times are coarse.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

import engine
import schedules
from engine.errors import PlanError, SplitError
from engine.planning.auto import CANDIDATES
from examples import gpt_model, llama_model, resnet_model

Model = tuple[Callable[..., Any], Any, tuple[Any, ...]]
BATCH = 32


def gpt(device: str) -> Model:
    config = gpt_model.GPTConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=8, head_dim=32)
    params = gpt_model.init_params(config, torch.float32, device)
    return gpt_model.make_loss_fn(config), params, gpt_model.example_batch(config, BATCH, device)


def llama(device: str) -> Model:
    config = llama_model.LlamaConfig(vocab_size=512, seq_len=64, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2,
                                     ffn_dim=384)
    fn, variables = engine.functionalize(llama_model.build(config, torch.float32, device), loss=llama_model.lm_loss)
    return fn, variables, llama_model.example_batch(config, BATCH, device)


def resnet(device: str) -> Model:
    """ResNet-50 at 1/8 width on 32x32 images, in eval mode (BatchNorm's running statistics are then constants)."""
    torch.manual_seed(0)
    model = resnet_model.build("resnet50x1", classes=10, base=8)
    model = (model.to("meta") if device == "meta" else model).eval()
    fn, variables = engine.functionalize(model, loss=F.cross_entropy)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, 3, 32, 32, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
    return fn, variables, (x.to(device), y.to(device))


MODELS: dict[str, Callable[[str], Model]] = {"gpt": gpt, "llama": llama, "resnet": resnet}
OPTIONS = {"stages": "auto", "dp": "auto", "microbatches": "auto"}
PIPELINE = {"stages": "auto", "dp": 1, "microbatches": "auto"}  # measured: a pipeline, where schedules differ


def _plan(model: Model, schedule: str, **options: Any) -> tuple[engine.Plan | None, float]:
    """The plan (None where nothing fits) and the seconds `engine.plan` took, with no order cached from an earlier
    plan (schedules.build_from_costs keeps them per process)."""
    fn, params, batch = model
    schedules.build_from_costs.cache_clear()
    start = time.perf_counter()
    try:
        found = engine.plan(fn, params, *batch, schedule=schedule, **OPTIONS, **options)
    except (PlanError, SplitError):
        found = None
    return found, time.perf_counter() - start


def predict_row(name: str, world: int, memory: str, args: argparse.Namespace, limit: int | None
                ) -> tuple[str, int | None]:
    """One row of the prediction table, and the tight limit this world's roomy auto plan implies. Each fixed
    schedule's time is what auto considered for it (the same search, one shared trace; an estimate where auto
    did not make it exact), or with `--independent` its own `engine.plan`; "1f1b" (the default until auto) is
    always planned on its own too, for the planning-time ratio."""
    model = MODELS[name]("meta")
    options = {"world_size": world, "device": args.device, "memory_limit": limit}
    _plan(model, "1f1b", **options)  # warm-up: torch's first traces of a process are slower
    default, default_s = _plan(model, "1f1b", **options)
    auto, auto_s = _plan(model, "auto", **options)
    if auto is None:
        return f"{name:7} {world:>2} {memory:6} auto: nothing fits", None
    considered = {s: t for s, _, t in auto.considered if t != float("inf")}
    own = {s: _plan(model, s, **options)[0] for s in CANDIDATES} if args.independent else {"1f1b": default}
    for s, p in own.items():  # a schedule planned on its own must predict what auto considered for it
        mine = p.predicted_step_time if p is not None else None
        if mine != considered.get(s):
            print(f"  note: {s} planned on its own predicts {mine}, auto considered {considered.get(s)}")
    rank = 1 + sum(t < auto.predicted_step_time - 1e-12 for t in considered.values())
    pruned = {s for s, text, _ in auto.considered if text.endswith("not made exact")}  # "~": auto's estimate
    cells = " ".join(f"{'~' if s in pruned else '':>1}{considered[s] * 1e3:7.2f}" if s in considered else f"{'-':>8}"
                     for s in CANDIDATES)
    tight = int(max(auto.rank_memory) * 0.5) if memory == "roomy" and auto.rank_memory else None
    layout = f"{auto.num_stages}x{auto.dp} m{auto.microbatches}"
    return (f"{name:7} {world:>2} {memory:6} {cells}  {auto.schedule:16} {layout:10} {rank:>4}  {auto_s:6.1f} "
            f"{default_s:6.1f} {auto_s / default_s:5.1f}x"), tight


def predict(args: argparse.Namespace) -> None:
    head = " ".join(f"{s[:8]:>8}" for s in CANDIDATES)
    print(f"predicted step (ms), device {args.device}, batch {BATCH}; stages, dp and microbatches auto")
    print(f"{'model':7} {'w':>2} {'memory':6} {head}  {'auto picks':16} {'stages x dp':10} rank  plan s: auto  "
          f"1f1b ratio")
    for name in args.models:
        for world in args.worlds:
            line, tight = predict_row(name, world, "roomy", args, None)
            print(line, flush=True)
            if tight is not None:
                print(predict_row(name, world, "tight", args, tight)[0], flush=True)


def measure(args: argparse.Namespace) -> None:
    from benchmarks.step_timer import measure as timed

    for name in args.models:
        model = MODELS[name]("cpu")
        fn, params, batch = model
        steps, plans = {}, {}
        for schedule in ("auto", *args.schedules):
            try:
                step = engine.parallelize(fn, params, *batch, schedule=schedule, **PIPELINE)
            except (PlanError, SplitError):
                continue
            steps[schedule], plans[schedule] = (step, step.shard(params)), step.plan
        rounds: dict[str, list[float]] = {s: [] for s in steps}
        for _ in range(args.runs):
            for schedule, (step, local) in steps.items():
                m = timed(lambda: step(local, *batch), loss_of=lambda out: float(out[0]), warmup=1,
                          steps=args.steps, device=step.world.device)
                rounds[schedule].append(statistics.median(m.times))
        for step, _ in steps.values():
            step.close()
        if torch.distributed.get_rank() == 0:
            _report(name, rounds, plans)


def _report(name: str, rounds: dict[str, list[float]], plans: dict[str, engine.Plan]) -> None:
    best = {s: min(t) for s, t in rounds.items()}
    fixed = {s: t for s, t in best.items() if s != "auto"}
    fastest = min(fixed, key=fixed.__getitem__)
    world = plans["auto"].pipeline_depth * plans["auto"].dp
    print(f"\n{name}, world {world}: measured step (least of the rounds' medians) against predicted")
    for s in sorted(best, key=best.__getitem__):
        p = plans[s]
        print(f"  {s:16} {best[s] * 1e3:9.1f} ms  predicted {p.predicted_step_time * 1e3:8.2f} ms  "
              f"({p.schedule}, {p.num_stages} stages x dp {p.dp}, {p.microbatches} microbatches)")
    print(f"  auto picks {plans['auto'].schedule}: auto / fastest fixed ({fastest}) measured = "
          f"{best['auto'] / fixed[fastest]:.3f}; auto / the same schedule fixed = "
          f"{best['auto'] / fixed.get(plans['auto'].schedule, float('nan')):.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,llama,resnet", type=lambda s: s.split(","))
    ap.add_argument("--worlds", default="2,4", type=lambda s: [int(w) for w in s.split(",")])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--measure", action="store_true", help="under mpirun: time auto and every fixed schedule")
    ap.add_argument("--independent", action="store_true", help="plan every fixed schedule on its own too")
    ap.add_argument("--schedules", default=",".join(CANDIDATES), type=lambda s: s.split(","),
                    help="the fixed schedules --measure times beside auto")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    (measure if args.measure else predict)(args)


if __name__ == "__main__":
    main()
