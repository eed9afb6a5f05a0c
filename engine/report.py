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
one traced step; an instruction's time includes waiting for the inputs it receives (the runtime waits
for a receive when it first reads the buffer), so stalls show up in the stage that waited. Measured
memory is `torch.cuda.max_memory_allocated` on GPU (pass `memory` for ranks other than this one), absent
on CPU.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import torch

import schedules

from .execution.program import COMPUTE, SHORT
from .planning.plan import Plan
from .execution.spans import Span, stage_times, timeline

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
        rank_rows.append([str(r), _ms(plan.predicted_step_time), _ms(meas_time),
                          _ratio(meas_time, plan.predicted_step_time),
                          _gb(pred_mem), _gb(meas_mem), _ratio(meas_mem, pred_mem)])
    lines = [f"predicted vs measured ({plan.schedule}, {plan.num_stages} stages, {plan.microbatches} microbatches; "
             "ratio = measured / predicted)"]
    lines += _table(header, rows)
    lines += [""] + _table(["rank", "step pred ms", "step meas ms", "step ratio", "peak pred GB", "peak meas GB",
                            "peak ratio"], rank_rows)
    return "\n".join(lines)


def log_compare(step: Any, spans: Sequence[Span], **kw: Any) -> str:
    """`compare`, also logged at INFO on `engine.report`."""
    text = compare(step, spans, **kw)
    log.info("%s", text)
    return text


def save_timeline_png(spans: Sequence[Span], path: str | Path, *, title: str | None = None) -> None:
    """The measured step as a picture (`schedules.save_png`, the colours and labels of a simulated one)."""
    schedules.save_png(timeline(spans), path, title=title)
