"""The stage programs as they run: each one's seconds and the bytes it allocates, measured before the first step.

The planner costs a plan from per-op timings, and the memory replay walks the fx program's frees; both miss
what a compiler does to a whole program (inductor fuses a norm into its matmul's epilogue, keeps a loss's
logits out of memory, or widens an embedding's backward to float32). So `parallelize` runs each of this
rank's programs on the device before the first step (`measure`), the ranks swap what they saw (`gather`),
and the Step predicts from the programs that will run: `Step.memory()` replays the program with each
compute's measured bytes in place of fx's, and `Step.predicted_step_time` simulates the plan's own schedule
with the measured F, B, W (or fused BW) seconds of every stage. Integer inputs of the batch come from the
example batch (stand-in zeros would send an embedding's whole backward to one row). Each rank times its
stages in two passes and keeps each program's faster time (`Executor.measure`, `faster_of`); `from_spans`
gives the same programs as a traced step ran them, to set beside these (`engine.report.against_programs`).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Sequence

import attrs
import torch

import schedules

from ..planning.calibration import Clock, settling_rounds
from ..planning.devices import get_device, get_link
from ..planning.measured import MeasuredScale, Span
from ..planning.plan import Plan
from ..units import nbytes
from .program import Instr, Program

Key = tuple[int, str, tuple[int, ...]]  # (stage, kind, accumulated output positions): one program
KIND = {"forward": "F", "backward_input": "B", "backward_weight": "W", "backward": "BW"}


@attrs.frozen
class ProgramCost:
    """One stage program measured on its rank's device: `seconds` a run (`in_turn`), the most bytes it held
    beyond its inputs during a run (None where the device keeps no allocator count), and `launch`, the host's
    seconds to hand a run to an idle device (`launch_seconds`; None off CUDA, where the host runs it)."""

    stage: int
    kind: str
    accumulate: tuple[int, ...] = attrs.field(converter=tuple)
    seconds: float
    peak_bytes: int | None
    launch: float | None = None

    @property
    def key(self) -> Key:
        return self.stage, self.kind, self.accumulate

    def __str__(self) -> str:
        made = "" if self.peak_bytes is None else f", makes {nbytes(self.peak_bytes)}"
        acc = f" (+{len(self.accumulate)} grads)" if self.accumulate else ""
        launch = "" if self.launch is None else f", launched in {self.launch * 1e3:.2f} ms"
        return f"{KIND[self.kind]}{self.stage}{acc}: {self.seconds * 1e3:.2f} ms{made}{launch}"


@attrs.frozen
class Profile:
    """Every rank's measured programs (a stage's programs are the same on each of its dp replicas)."""

    programs: tuple[ProgramCost, ...] = attrs.field(converter=tuple)

    def of(self, key: Key) -> ProgramCost | None:
        return next((p for p in self.programs if p.key == key), None)

    def peak(self, key: Key) -> int | None:
        found = self.of(key)
        return None if found is None else found.peak_bytes

    def to_json(self) -> list[dict[str, Any]]:
        return [attrs.asdict(p) for p in self.programs]

    @classmethod
    def from_json(cls, rows: Sequence[dict[str, Any]]) -> Profile:
        return cls(ProgramCost(**row) for row in rows)

    def __str__(self) -> str:
        return "\n".join(map(str, sorted(self.programs, key=lambda p: p.key)))


Run = Callable[[], Any]


def program_label(key: Key) -> str:
    """A program's name in a profiler trace (`torch.profiler.record_function` around each timed run, and around
    each compute of a step whose executor has `annotate` on): its stage, F / B / W / BW, and "+" where it adds
    into grad accumulators, e.g. "3W+"."""
    stage, kind, accumulate = key
    return f"{stage}{KIND[kind]}{'+' if accumulate else ''}"


def measure(runs: Sequence[tuple[Key, Run]], device: torch.device, *, reps: int = 3, settle: float = 0.0
            ) -> tuple[ProgramCost, ...]:
    """Each program of `runs` (one stage's, already run once: compiled, kernels loaded) run again under the
    allocator's peak counter, then all of them timed in turn (`in_turn`) after `settle` seconds of them back to
    back (`engine.planning.calibration.settle_seconds`), each named by `program_label`, and on CUDA each one's
    launch from an idle device (`launch_seconds`)."""
    made = [_bytes_made(run, device) for _, run in runs]
    seconds = in_turn([_named(program_label(key), run) for key, run in runs], Clock(device), reps,
                      between=cold_cache(device) if cold() else None, settle=settle)
    launches = [launch_seconds(run, device, reps) for _, run in runs]
    return tuple(ProgramCost(*key, seconds=t, peak_bytes=b, launch=h)
                 for (key, _), t, b, h in zip(runs, seconds, made, launches))


def launch_seconds(run: Run, device: torch.device, reps: int = 3) -> float | None:
    """The host's seconds to issue `run` to an idle device, the median of `reps` (each after a sync, its
    outputs dropped at once); None off CUDA. A program whose launches take about what its kernels do bounds a
    step by its host, not its device (`schedules.Costs.issue_forward`)."""
    if device.type != "cuda":
        return None
    seconds = []
    for _ in range(max(1, reps)):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        outs = run()
        seconds.append(time.perf_counter() - start)
        del outs
    torch.cuda.synchronize(device)
    return statistics.median(seconds)


def _named(label: str, run: Run) -> Run:
    def named() -> Any:
        with torch.profiler.record_function(label):
            return run()
    return named


def cold() -> bool:
    """FNPIPE_PROFILE_COLD=1: time each program from a cold L2 cache (`cold_cache` before it), as a step runs a
    program whose inputs were made long before (an experiment: off by default)."""
    return os.environ.get("FNPIPE_PROFILE_COLD", "0").strip().lower() in ("1", "true", "yes", "on")


def cold_cache(device: torch.device) -> Run | None:
    """A run that writes twice the device's L2 cache, so nothing a program read or wrote before it is left there;
    None off CUDA."""
    if device.type != "cuda":
        return None
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    scratch = torch.empty(2 * size, dtype=torch.uint8, device=device)
    return lambda: scratch.fill_(1)


def in_turn(runs: Sequence[Run], clock: Clock, reps: int, *, between: Run | None = None,
            settle: float = 0.0) -> list[float]:
    """Seconds of each run as a step sees them: all of them one after another (F, then the backward programs,
    as a step alternates them), `reps` + 1 rounds back to back with no sync between, a clock mark before each
    run; a run's seconds are the median over the rounds after the first of the time from its mark to the
    next. On a GPU a mark is reached when the device gets there, so a run is charged what it adds to a
    device that is never left waiting by the host unless the run itself is launch-bound: a ResNet's fx
    forward (a thousand small kernels) timed alone counts its launches in full, while in a step they overlap
    the backward before it (one H200, resnet101x4 fx: programs timed alone predicted 1.16 x the step,
    2026-11-26). The first round starts from an idle device and is left out. `between`: run before each run,
    outside its time (a run is then charged from its mark to a mark right after it). `settle`: seconds of
    untimed rounds right before the timed ones, with no sync between (`settle_seconds`)."""
    settling = settling_rounds(settle, lambda: [run() for run in runs], clock)
    clock.start()
    for _ in range(settling):
        for run in runs:
            run()
    for _ in range(reps + 1):
        for run in runs:
            if between is not None:
                between()
            clock.mark()
            run()  # its outputs dropped at once, as a step drops what it no longer needs
            if between is not None:
                clock.mark()
    clock.mark()
    gaps = clock.gaps()[::2] if between is not None else clock.gaps()  # with `between`: run, between, run, ...
    n = len(runs)
    return [statistics.median(gaps[r * n + i] for r in range(1, reps + 1)) for i in range(n)]


def _bytes_made(run: Run, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    outs = run()
    made = torch.cuda.max_memory_allocated(device) - before
    del outs
    return int(made)


def gather(mine: Sequence[ProgramCost], all_gather_json: Callable[[Any], list[Any]]) -> Profile:
    """Every rank's measurements, each program once (a collective: every rank calls it)."""
    seen: dict[Key, ProgramCost] = {}
    for part in all_gather_json([attrs.asdict(p) for p in mine]):
        for row in part:
            cost = ProgramCost(**row)
            seen.setdefault(cost.key, cost)
    return Profile(tuple(seen.values()))


# -- the step predicted from the measured programs ------------------------------------------------------
def stage_seconds(profile: Profile, programs: Sequence[Program], num_stages: int, field: str = "seconds"
                  ) -> tuple[list[float], list[float], list[float]] | None:
    """Per stage, the mean measured seconds (`field` of ProgramCost: "seconds", or "launch" for the host's) of
    its F, B and W over the instructions that run them; None if any program that runs was not measured (or
    has no such number). The simulator costs a BW action as B + W: a stage that runs B and W apart gives
    those (its fused BW actions, if the order also has some, cost their sum; a first stage may run W alone,
    with no input grad to make); a stage that only runs fused BW gives it as B, with W 0."""
    sums: dict[tuple[int, str], list[float]] = {}
    for ins in (i for p in programs for i in p.instrs if i.kind in KIND):
        found = profile.of((ins.stage, ins.kind, ins.accumulated()))
        value = None if found is None else getattr(found, field)
        if value is None:
            return None
        sums.setdefault((ins.stage, KIND[ins.kind]), []).append(value)
    mean = {k: sum(v) / len(v) for k, v in sums.items()}
    f = [mean.get((s, "F"), 0.0) for s in range(num_stages)]
    split = [(s, "B") in mean or (s, "W") in mean for s in range(num_stages)]  # stage 0 may need no B at all
    b = [mean.get((s, "B"), 0.0) if split[s] else mean.get((s, "BW"), 0.0) for s in range(num_stages)]
    w = [mean.get((s, "W"), 0.0) if split[s] else 0.0 for s in range(num_stages)]
    return f, b, w


def faster_of(a: Profile, b: Profile) -> Profile:
    """Two measurements of the same programs as one: per program the smaller seconds and launch (a hiccup of a
    shared device or host, another process's compile, only ever adds time) and the larger bytes; a program
    measured in one only is kept as it is."""
    merged = {p.key: p for p in a.programs}
    for p in b.programs:
        q = merged.get(p.key)
        if q is None:
            merged[p.key] = p
            continue
        peaks = [x for x in (p.peak_bytes, q.peak_bytes) if x is not None]
        launches = [x for x in (p.launch, q.launch) if x is not None]
        merged[p.key] = attrs.evolve(q, seconds=min(p.seconds, q.seconds), peak_bytes=max(peaks) if peaks else None,
                                     launch=min(launches) if launches else None)
    return Profile(merged[k] for k in sorted(merged))


def from_spans(spans: Sequence[Any], programs: Sequence[Program]) -> Profile:
    """The programs as a traced step ran them (`Step.traced`'s spans, every rank's or some): per distinct
    program, the median seconds of its instructions from when their inputs were there to their end
    (`Span.busy`). What it takes in a step beside the other stage's work, the transfers and the runtime,
    where `measure` times each program in turn on its own. No bytes."""
    key_of = {(p.rank, i.stage, i.kind, i.mb): (i.stage, i.kind, i.accumulated())
              for p in programs for i in p.instrs if i.kind in KIND}
    seconds: dict[Key, list[float]] = {}
    for s in spans:
        key = key_of.get((s.rank, s.stage, s.kind, s.mb))
        if key is not None:
            seconds.setdefault(key, []).append(s.busy)
    return Profile(ProgramCost(*key, seconds=statistics.median(v), peak_bytes=None)
                   for key, v in sorted(seconds.items()))


def measured_scale(plan: Plan, programs: Sequence[Program], profile: Profile) -> MeasuredScale | None:
    """Each stage's measured over planned F, B and W seconds, on its equations (`engine.planning.measured`); a
    stage that runs fused BW gives B and W its BW ratio. None if a program that runs was not measured."""
    times = stage_seconds(profile, programs, plan.num_stages)
    if times is None:
        return None
    f, b, w = times
    split = {i.stage for p in programs for i in p.instrs if i.kind in ("backward_input", "backward_weight")}
    spans = []
    for s, st in enumerate(plan.stages):
        both = st.backward_input_time + st.backward_weight_time
        if s not in split:  # fused BW only: stage_seconds gave it as B
            rb = rw = fused = _over(b[s], both)
        else:
            rb, rw = _over(b[s], st.backward_input_time), _over(w[s], st.backward_weight_time)
            fused = _over(b[s] + w[s], both)
            if not (b[s] > 0 and st.backward_input_time > 0):  # the first stage: W holds its whole backward
                rb = rw
        spans.append(Span(st.start, st.stop, _over(f[s], st.forward_time), rb, rw, fused))
    return MeasuredScale(plan.num_eqns, spans, per_stage=True)


def _over(measured: float, planned: float) -> float:
    """measured / planned, 1 where either is 0 (a stage with no B: the first, which makes no input grad)."""
    return measured / planned if measured > 0 and planned > 0 else 1.0


def against_plan(plan: Plan, programs: Sequence[Program], profile: Profile) -> str | None:
    """Per stage, the planner's F and B + W milliseconds a microbatch beside the measured programs', and their
    ratio (where the op costs misjudge a stage); None if a program that runs was not measured.

        stage   F plan  F run   run/plan   B+W plan  B+W run   run/plan
            0     4.10   3.90      0.95       8.30     9.10      1.10
    """
    times = stage_seconds(profile, programs, plan.num_stages)
    if times is None:
        return None
    f, b, w = times
    rows = [f"{'stage':>5} {'F plan':>8} {'F run':>8} {'run/plan':>9} {'B+W plan':>9} {'B+W run':>8} {'run/plan':>9}"]
    for s, st in enumerate(plan.stages):
        planned_b = st.backward_input_time + st.backward_weight_time
        rows.append(f"{s:>5} {st.forward_time * 1e3:8.2f} {f[s] * 1e3:8.2f} {_ratio(f[s], st.forward_time):>9} "
                    f"{planned_b * 1e3:9.2f} {(b[s] + w[s]) * 1e3:8.2f} {_ratio(b[s] + w[s], planned_b):>9}")
    return "\n".join(rows)


def _ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.2f}" if planned > 0 else "-"


def predicted_step_time(plan: Plan, table: schedules.Table, programs: Sequence[Program],
                        profile: Profile, posts: Sequence[float | None] | None = None, *,
                        replayed: bool = False) -> float | None:
    """The plan's schedule simulated as the planner does (compute in each rank's order, a transfer on each
    edge between ranks over the plan's link) with the measured seconds of every stage's programs, plus the
    plan's data-parallel all-reduce. None for unequal replicas per stage (their routed rows are not
    rebuilt here) or when a program that runs was not measured. Where every program's launch was measured
    (CUDA), each rank's host is simulated too (`host_costs`): it issues the programs and, given `posts`
    (per world rank, `post_cost.post_seconds`), posts every transfer, never waiting for its device; a rank
    whose host is slower than its device then follows its host. `replayed`: the computes replay CUDA graphs
    (`engine.execution.graphs`), whose launch is a few microseconds: the host only posts."""
    if any(c != plan.replicas[0] for c in plan.replicas):
        return None
    times = stage_seconds(profile, programs, plan.num_stages)
    if times is None:
        return None
    f, b, w = times
    link = get_link(plan.link or None, get_device(plan.device))
    costs = schedules.Costs(forward=tuple(f), backward_input=tuple(b), backward_weight=tuple(w),
                            comm_latency=link.latency, comm_bandwidth=link.bandwidth,
                            activation_bytes=tuple(float(s.send_bytes) for s in plan.stages),
                            **host_costs(profile, programs, plan.num_stages, posts, replayed=replayed))
    return schedules.simulate(compute_only(table), costs).makespan + plan.allreduce_time


def host_costs(profile: Profile, programs: Sequence[Program], num_stages: int,
               posts: Sequence[float | None] | None = None, *, replayed: bool = False) -> dict[str, tuple[float, ...]]:
    """`schedules.Costs`' host fields from the measured launches (each stage's mean, as `stage_seconds`; none with
    `replayed` graphs) and posts (a boundary's transfer costs the mean of the posts of the ranks on its two sides,
    each stage's first rank); empty where a launch was not measured (off CUDA: the host runs the programs itself)."""
    launches = stage_seconds(profile, programs, num_stages, "launch")
    if launches is None:
        return {}
    f, b, w = ([0.0] * num_stages for _ in range(3)) if replayed else launches
    out = {"issue_forward": tuple(f), "issue_backward_input": tuple(b), "issue_backward_weight": tuple(w)}
    if posts is None:
        return out
    rank_of: dict[int, int] = {}
    for p in programs:
        for ins in p.instrs:
            if ins.kind in KIND:
                rank_of.setdefault(ins.stage, p.rank)
    known = [x for x in posts if x is not None]
    if known and len(rank_of) == num_stages:
        fill = statistics.mean(known)
        post = [fill if x is None else x for x in posts]
        out["issue_transfer"] = tuple((post[rank_of[s]] + post[rank_of[min(s + 1, num_stages - 1)]]) / 2
                                      for s in range(num_stages))
    return out


def compute_only(table: schedules.Table) -> schedules.Table:
    """A lowered table without its sends and receives: each rank's compute order, as the planner simulates
    it (the runtime posts sends without waiting on them, so a send never holds its rank back)."""
    rows = [[a for a in row if a.is_compute] for row in table.rows]
    return schedules.Table(table.num_stages, table.num_microbatches, table.stage_to_rank, rows)


def first_instructions(program: Program) -> dict[Key, Instr]:
    """The first instruction of each distinct program this rank runs, in program order."""
    first: dict[Key, Instr] = {}
    for ins in program.instrs:
        if ins.kind in KIND:
            first.setdefault((ins.stage, ins.kind, ins.accumulated()), ins)
    return first
