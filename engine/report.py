"""Predicted vs measured: the plan's per-stage F/B/W times and peak memory against a traced step, and its timeline.

    loss, grads, spans = step.traced(params, x, y)      # after a few steps: warm caches and allocator
    print(engine.report.compare(step, spans))           # this rank's stages
    every, memory = engine.report.gather(step, spans)   # a collective: every rank calls it
    if step.world.rank == 0:
        print(engine.report.compare(step, every, memory=memory))
        engine.report.save_timeline_png(every, "timeline.png")
        engine.execution.spans.save_perfetto(every, "trace.json")   # ui.perfetto.dev

Ratios are measured / predicted: above 1 the plan was optimistic. Per stage the table also says its
recomputation ("no", "cheap": norms and pointwise chains, "full": the forward) and the seconds its programs
took to compile on this rank ("-": fx programs, or another rank's stage). Times are medians over microbatches of
one traced step, each from when the instruction's inputs were there (the runtime waits for a receive when
it first reads the buffer); what each rank's computes waited for their inputs is a column of the rank table
(a receive first read by something else, a send or the loss sums, is not in it). Measured
memory is `torch.cuda.max_memory_allocated` on GPU (pass `memory` for ranks other than this one), absent
on CPU.
"""
from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import torch

import schedules

from .execution.program import COMPUTE, SHORT
from .planning.plan import Plan
from .execution.profile import from_spans, predicted_step_time
from .execution.spans import Span, stage_times, timeline, traced_instrs

log = logging.getLogger("engine.report")
KINDS = tuple(SHORT.items())  # (instruction kind, its letter as a schedule action)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.4g}"


def _gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e9:.4g}"


def _ratio(measured: float | None, predicted: float | None) -> str:
    return "-" if measured is None or not predicted else f"{measured / predicted:.2f}"


def _predicted(plan: Plan, stage: int, kind: str) -> float:
    s = plan.stages[stage]
    return {"forward": s.forward_time, "backward_input": s.backward_input_time,
            "backward_weight": s.backward_weight_time,
            "backward": s.backward_input_time + s.backward_weight_time}[kind]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    return [" ".join(c.rjust(w) for c, w in zip(line, widths)) for line in (header, *rows)]


def step_time(spans: Sequence[Span], rank: int) -> float | None:
    """Seconds from the first to the last instruction of `rank` in `spans` (one step's spans)."""
    mine = [s for s in spans if s.rank == rank]
    return max(s.end for s in mine) - min(s.start for s in mine) if mine else None


def measured_memory(step: Any) -> dict[int, float]:
    """This rank's peak allocated bytes on GPU since the last reset ({} on CPU)."""
    device = step.world.device
    if device.type != "cuda":
        return {}
    return {step.world.rank: float(torch.cuda.max_memory_allocated(device))}


def gather(step: Any, spans: Sequence[Span]) -> tuple[list[Span], dict[int, float]]:
    """Every rank's spans and measured peak memory (a collective: call it on all ranks)."""
    mine = [[attrs.asdict(s) for s in spans], [[r, m] for r, m in measured_memory(step).items()]]
    parts = step.transport.all_gather_json(mine)  # JSON, never pickles, from the peers
    return [Span(**s) for part, _ in parts for s in part], {int(r): float(m) for _, mem in parts for r, m in mem}


def compare(step: Any, spans: Sequence[Span], *, memory: Mapping[int, float] | None = None) -> str:
    """A table per stage in `spans`: predicted, measured and ratio of F, B and W (ms per microbatch);
    then per world rank in `spans`: predicted and measured step time and peak memory (predicted: the
    rank's program replayed, `step.memory()`; measured: `memory`, else this rank's CUDA peak)."""
    plan: Plan = step.plan
    measured = stage_times(spans)
    stages = sorted({s.stage for s in spans if s.kind in COMPUTE})
    kinds = [(kind, k) for kind, k in KINDS if any(key[1] == kind for key in measured)]  # those the schedule ran
    header = ["stage", "rank", "recompute"]
    compiled = getattr(step, "compile_seconds", {})
    for _, k in kinds:
        header += [f"{k} pred ms", f"{k} meas ms", f"{k} ratio"]
    header.append("compile s")
    rows = []
    for st in stages:
        level = "full" if plan.recompute[st] else "cheap" if plan.remat[st] else "no"
        row = [str(st), str(plan.stages[st].rank), level]
        for kind, _ in kinds:
            pred, meas = _predicted(plan, st, kind), measured.get((st, kind))
            row += [_ms(pred), _ms(meas), _ratio(meas, pred)]
        rows.append([*row, f"{compiled[st]:.1f}" if st in compiled else "-"])
    mem = dict(measured_memory(step) if memory is None else memory)
    ranks = sorted({s.rank for s in spans})
    replayed = step.memory()
    rank_rows = []
    for r in ranks:
        pred_mem = replayed[r].peak if r < len(replayed) else None
        meas_time, meas_mem = step_time(spans, r), mem.get(r)
        waited = sum(s.waited for s in spans if s.rank == r and s.kind in COMPUTE)
        rank_rows.append([str(r), _ms(plan.predicted_step_time), _ms(meas_time),
                          _ratio(meas_time, plan.predicted_step_time), _ms(waited),
                          _gb(pred_mem), _gb(meas_mem), _ratio(meas_mem, pred_mem)])
    lines = [f"predicted vs measured ({plan.schedule}, {plan.num_stages} stages, {plan.microbatches} microbatches; "
             "ratio = measured / predicted)"]
    lines += _table(header, rows)
    lines += [""] + _table(["rank", "step pred ms", "step meas ms", "step ratio", "waited ms", "peak pred GB",
                            "peak meas GB", "peak ratio"], rank_rows)
    return "\n".join(lines)


def against_programs(step: Any, spans: Sequence[Span]) -> str | None:
    """Why a step is slower than its programs simulated: per rank in `spans`, its programs' milliseconds as
    timed at start-up (`step.profile`, each in turn on its own) and as this step ran them (from when their
    inputs were there to their end), their ratio, what its computes waited for their inputs, and its step time;
    then the plan's schedule simulated with either (`step.predicted_step_time`, and the same with this
    step's durations). A step that matches the second simulation but not the first ran its programs
    slower than they were timed; one slower than both waited on something the simulation does not have.
    On GPU, the host's lead: how long each program still ran after the host had issued it (`Span.lead`),
    the least and the median; near zero, the device waited on the host.
    None before `profile_programs`.

        rank  start-up ms  in step ms  ratio  waited ms  step ms  host lead ms min / median
           0        81.30       88.90  1.094       9.20   105.80  4.81 / 12.30
        simulated: from the start-up programs 96.5 ms, from this step's 104.9 ms; measured 105.8 ms
    """
    profile = getattr(step, "profile", None)
    if profile is None:
        return None
    programs = step.programs.all()
    rows = []
    for r in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == r and s.kind in COMPUTE]
        keys = [(i.stage, i.kind, i.accumulated()) for i in programs[r].instrs if i.kind in COMPUTE]
        costs = [profile.of(k) for k in keys]
        start_up = sum(c.seconds for c in costs) if all(c is not None for c in costs) else None
        in_step = sum(s.busy for s in mine)
        leads = sorted(s.lead for s in mine if s.lead is not None)
        rows.append([str(r), _ms(start_up), _ms(in_step), f"{in_step / start_up:.3f}" if start_up else "-",
                     _ms(sum(s.waited for s in mine)), _ms(step_time(spans, r)),
                     f"{_ms(leads[0])} / {_ms(statistics.median(leads))}" if leads else "-"])
    ran = predicted_step_time(step.plan, step.table, programs, from_spans(spans, programs))
    slowest = max((t for t in (step_time(spans, r) for r in {s.rank for s in spans}) if t is not None), default=None)
    lines = ["the step against its programs (ms; start-up: timed in turn before the first step; in step: this "
             "step's, from inputs ready to end)"]
    lines += _table(["rank", "start-up ms", "in step ms", "ratio", "waited ms", "step ms", "host lead ms min / median"],
                    rows)
    lines.append(f"simulated: from the start-up programs {_ms(step.predicted_step_time)} ms, from this step's "
                 f"{_ms(ran)} ms; measured {_ms(slowest)} ms")
    return "\n".join(lines)


def beside_receives(step: Any, spans: Sequence[Span]) -> str | None:
    """Whether programs ran slower beside a posted receive: per rank in `spans`, its computes' in-step time over
    their start-up time (`step.profile`), the median for those that ran at least half their time while a
    receive this rank had posted still waited for its data, and for the others. A receive waits from its comm
    instruction's start until the first instruction that reads it had its data (`_receives_waiting`). An NCCL receive
    posted before its sender holds SMs while it waits (`benchmarks/contention.py`: compute beside one ran
    1.37 x on an H100); the ones beside nothing show what else a step adds. None before `profile_programs`, and
    a rank's row is "-" where its spans are not one per traced instruction of its program (a hook skipped one).

        rank  beside a receive: computes  median ratio  beside none: computes  median ratio
           0                          48         1.113                     44         1.075
    """
    profile = getattr(step, "profile", None)
    if profile is None:
        return None
    programs = step.programs.all()
    rows = [_beside_row(r, [s for s in spans if s.rank == r], traced_instrs(programs[r].instrs), profile)
            for r in sorted({s.rank for s in spans})]
    return "\n".join(["computes beside a receive still waiting for its data, against the others (in-step / start-up "
                      "time)"] + _table(["rank", "beside a receive: computes", "median ratio", "beside none: computes",
                                         "median ratio"], rows))


def _beside_row(rank: int, mine: Sequence[Span], instrs: Sequence[Any], profile: Any) -> list[str]:
    """One rank's row of `beside_receives`: its computes beside a waiting receive and beside none, each with the
    median of their in-step over start-up seconds ("-" throughout where spans and instructions do not pair)."""
    if len(mine) != len(instrs):
        return [str(rank), "-", "-", "-", "-"]
    waits = _receives_waiting(instrs, mine)
    split: tuple[list[float], list[float]] = ([], [])
    for ins, sp in zip(instrs, mine):
        cost = profile.of((ins.stage, ins.kind, ins.accumulated())) if ins.kind in COMPUTE else None
        if cost is None or cost.seconds <= 0 or sp.busy <= 0:
            continue
        beside = covered_seconds(waits, sp.end - sp.busy, sp.end) >= sp.busy / 2
        split[0 if beside else 1].append(sp.busy / cost.seconds)
    return [str(rank), *(cell for ratios in split for cell in (str(len(ratios)), _median(ratios)))]


def _receives_waiting(instrs: Sequence[Any], spans: Sequence[Span]) -> list[tuple[float, float]]:
    """(posted, data there) of each receive in one rank's program (a comm instruction may post several): its comm
    span's start, and when the first instruction after it that reads one of its buffers had it: a compute's
    `ready` (else its start), another instruction's end (a send of a buffer passed through waits inside it)."""
    waits = []
    for k, ins in enumerate(instrs):
        for op in (op for op in ins.comm if op.op == "recv"):
            bufs = set(op.bufs)
            reader = next((j for j in range(k + 1, len(instrs)) if bufs & set(_reads_of(instrs[j]))), None)
            if reader is not None:
                waits.append((spans[k].start, _had_data(instrs[reader], spans[reader])))
    return waits


def _reads_of(ins: Any) -> tuple[str, ...]:
    """The buffers an instruction reads: a compute's `reads`, a comm instruction's sent buffers."""
    return ins.reads + tuple(b for op in ins.comm if op.op == "send" for b in op.bufs)


def _had_data(ins: Any, span: Span) -> float:
    if ins.kind in COMPUTE:
        return span.ready if span.ready is not None else span.start
    return span.end


def covered_seconds(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside at least one of `intervals`."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    total, reach = 0.0, start
    for a, b in clipped:
        total += max(0.0, b - max(a, reach))
        reach = max(reach, b)
    return total


def _median(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "-"


def log_compare(step: Any, spans: Sequence[Span], **kw: Any) -> str:
    """`compare`, also logged at INFO on `engine.report`."""
    text = compare(step, spans, **kw)
    log.info("%s", text)
    return text


def save_timeline_png(spans: Sequence[Span], path: str | Path, *, title: str | None = None) -> None:
    """The measured step as a picture (`schedules.save_png`, the colours and labels of a simulated one)."""
    schedules.save_png(timeline(spans), path, title=title)
