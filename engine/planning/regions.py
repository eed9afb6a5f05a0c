"""Region scales: the calibration's program scale measured on spans of the model as well as on the whole.

One program scale for the whole model misjudges a stage whose ops fuse (or overlap, or miss the cache) better or
worse than the model's average: ResNet-101x4 cut in two on 2 x H100 (inductor, 2026-11-26) ran its first
stage's forward 1.18 x the plan and the second's 0.81 x, and the planner predicted the step 1.17 x fast. So
after `calibrate_training`, `with_regions` cuts the model at module boundaries into REGIONS spans of about equal
calibrated forward time, runs each span's forward and fused backward program as the runtime will (compiled by
the compiler the plan is for, at the recompute level of its whole-model scale, the real params and microbatch
flowing from span to span) and keeps each span's seconds over its ops' calibrated sum. Those ratios are
normalised to a time-weighted mean of 1: the whole model's scale stays what the whole program measured (a span's
own program pays launches and boundaries no stage of a plan pays twice), and the spans say how that time is
spread. The result is a `MeasuredScale` over the microbatch graph's equations (`engine.planning.measured`),
which the cost model applies to plans of that graph (`CostModel.scale_of`); a rebalance's stage ratios multiply
on top. A scale is kept per compiler for one microbatch graph, known by its equation count and `batch_key` (its
batch shapes): a table reused after an edit of the model that keeps those and every op signature would keep
stale spans, and two jobs of other microbatch sizes sharing a table measure them again in turn. A cut makes ops
the whole model's programs lack (a span's first convolution computes an input grad); they are timed and join the
table.
"""
from __future__ import annotations

import itertools
import logging
from typing import Mapping, Sequence

import attrs
import torch

import ir

from .artifacts import autodiff
from .blocks import crossing_bytes, module_cuts
from .calibration import (Calibration, ProgramCompiler, ProgramRuns, Programs, calibrate, ops_sums, signature,
                          split_sums)
from .measured import MeasuredScale, Span, batch_key

log = logging.getLogger("engine.calibrate")
REGIONS = 4  # spans a model is timed in: each costs a compile of its forward and backward programs on rank 0


def region_cuts(times: Sequence[float], regions: int = REGIONS, candidates: Sequence[int] | None = None) -> list[int]:
    """Cut points (equation indices, strictly inside the graph) splitting equations of forward `times` into at
    most `regions` spans of about equal time, each taken from `candidates` (a model's module boundaries) where
    given, else anywhere: the candidate whose time before it is nearest each 1/regions share, if within half a
    share of it (uneven boundaries give fewer regions, not slivers)."""
    total = sum(times)
    points = sorted(c for c in (candidates if candidates is not None else range(1, len(times))) if 0 < c < len(times))
    if total <= 0 or regions < 2 or not points:
        return []
    prefix = list(itertools.accumulate(times, initial=0.0))  # prefix[i]: the time before equation i
    before = [prefix[p] for p in points]
    cuts: list[int] = []
    for k in range(1, regions):
        target = total * k / regions
        best = min(range(len(points)), key=lambda j: abs(before[j] - target))
        near = abs(before[best] - target) <= total / (2 * regions)  # else a sliver of a region: launches, no work
        if near and (not cuts or points[best] > cuts[-1]) and 0 < before[best] < total:
            cuts.append(points[best])
    return cuts


def with_regions(g: ir.Graph, device: torch.device, table: Calibration, inputs: Sequence[torch.Tensor],
                 compilers: Mapping[str, ProgramCompiler], known: Calibration | None = None) -> Calibration:
    """`table` (from `calibrate_training` on microbatch graph `g` and its real `inputs`) with each of
    `compilers`' region scales: kept from `known` (the table as loaded) where nothing they rest on changed (the
    op times, the graph), else measured; other compilers' scales are kept while they hold. A failed measurement is
    kept as a scale of no spans (nothing applies), so later launches do not retry it until the table changes."""
    out = {name: r for name, r in table.regions.items() if _current(name, table, known, g)}  # the rest is stale
    for name, compiler in compilers.items():
        if name in out:
            continue
        found, table = region_scale(g, device, table, inputs, level=False if name == "fx" else "cheap",
                                    compile_program=compiler)
        out[name] = found if found is not None else MeasuredScale(len(g.eqns), (), batch_key(g))
    return attrs.evolve(table, regions=out)


def _current(name: str, table: Calibration, known: Calibration | None, g: ir.Graph) -> bool:
    """Whether `known`'s region scales of compiler `name` still hold for `table` and graph `g`: measured on this
    graph, and no op timed anew since (the whole model's scale does not enter them: they are normalised)."""
    if known is None or name not in known.regions or not known.regions[name].matches(g):
        return False
    return table.times == known.times


def region_scale(g: ir.Graph, device: torch.device, cal: Calibration, inputs: Sequence[torch.Tensor], *,
                 level: bool | str = False, repeats: int = 3,
                 compile_program: ProgramCompiler = ir.compile_graph,
                 regions: int = REGIONS) -> tuple[MeasuredScale | None, Calibration]:
    """Each region's (`region_cuts` of `g`) measured over its ops' calibrated forward and backward seconds,
    normalised (the module docstring), and `cal` with the ops only the regions' programs have timed. None when the
    model is too small to cut, a region's program cannot run here (logged: out of memory, say), or some op of it
    cannot be timed alone (logged)."""
    times = [cal.times.get(signature(e), 0.0) for e in g.eqns]
    cuts = region_cuts(times, regions, module_cuts(g, crossing_bytes(g)) or None)
    if not cuts or len(inputs) != len(g.inputs):
        return None, cal
    values: dict[int, torch.Tensor] = {}  # crossing value id -> its tensor, from the region before
    measured = []  # per region: (its stage, its ops' sums, its programs' seconds, its programs while held)
    for stage in ir.split(g, cuts):
        ad = autodiff(stage, level, device=str(device))  # as a plan's stage's programs are made
        for part in (ad.forward, ad.backward, ad.backward_input, ad.backward_weight):
            cal = calibrate(part.graph, device, calibration=cal)
        sums = ops_sums(ad, stage.graph, cal)
        if sums.missing:
            log.warning("region scales not measured: %d of %d ops of equations %d:%d could not be timed alone",
                        sums.missing, sums.ops, stage.start, stage.stop)
            return None, cal
        ins = [inputs[i] for i in (*stage.param_ids, *stage.batch_ids)] + [values[v] for v in stage.acts_in]
        try:
            ran, programs = _held_timed(ad, device, ins, sums.accumulate, sums.param_grads, repeats,
                                        compile_program, measured)
        except RuntimeError as err:  # out of memory, a compiler's failure: the whole model's scale stands alone
            log.warning("region scales not measured (equations %d:%d): %s: %s", stage.start, stage.stop,
                        type(err).__name__, err)
            return None, cal
        values.update(zip(stage.acts_out, ran.outs))
        measured.append((stage, ad, sums, ran, programs))
        del programs  # held in `measured` alone: letting go there frees it
    runs = []  # per region: (start, stop, forward sum, backward sum, forward seconds, backward seconds,
    # B's and W's factors on the backward's ratio)
    for (stage, ad, sums, first, _), again in zip(measured, _again([m[4] for m in measured], repeats)):
        ran = _faster(first, again)
        runs.append((stage.start, stage.stop, sums.forward, sums.backward, ran.forward, ran.backward,
                     *_split_shares(ran, sums.backward, *split_sums(ad, cal, sums.param_grads, stage.graph))))
    found = MeasuredScale(len(g.eqns), _normalised(runs), batch_key(g))
    log.info("calibration: regions run %s their ops' calibrated sum, over the model's mean", found)
    return found, cal


def _held_timed(ad: ir.StageAD, device: torch.device, ins: Sequence[torch.Tensor], acc: tuple[int, ...],
                param_grads: dict[int, int], repeats: int, compile_program: ProgramCompiler,
                measured: list[tuple]) -> tuple[ProgramRuns, Programs]:
    """A region's programs timed with its backward split as well, and the programs, held for their second
    timing (`_again`) beside the regions' before it. Where that leaves too little memory, the regions before are
    let go (each keeps its first timing) and it is tried again; where the split programs still cannot run (they
    hold a second set of weight grads and B's hand-over beside the fused backward's), the forward and fused
    backward alone, so the region keeps its scale with one ratio for B and W (both logged)."""
    def attempt(split: bool) -> tuple[ProgramRuns, Programs]:
        programs = Programs(ad, device, ins, acc, param_grads, compile_program, split=split)
        return programs.timed(repeats), programs

    try:
        return attempt(True)
    except RuntimeError as err:
        failed = err.with_traceback(None)  # its frames would hold the failed attempt's tensors
    if any(m[4] is not None for m in measured):
        log.warning("regions timed once: holding them for a second timing leaves too little memory (%s: %s)",
                    type(failed).__name__, failed)
        measured[:] = [(*m[:4], None) for m in measured]
        _free(device)
        try:
            return attempt(True)
        except RuntimeError as err:
            failed = err.with_traceback(None)
    log.warning("region B and W not timed apart (one ratio for both): %s: %s", type(failed).__name__, failed)
    _free(device)
    return attempt(False)


def _again(held: Sequence[Programs | None], repeats: int) -> list[ProgramRuns | None]:
    """Every region's programs timed a second time, once all are compiled. The first timing of a region runs
    right after its compile, beside whatever the host still does (a compiler's workers, other ranks' compiles:
    a program whose launches outrun its kernels then runs slow), and one outlier skews the planner: a Llama's
    fourth to ninth blocks, alike, timed 0.94 x and 1.17 x the model's mean forward in two regions
    (4 x H100, 2026-11-27). All None where a region was let go or fails now: the regions are normalised against
    each other, so all keep their first timing rather than some the faster of two."""
    out: list[ProgramRuns | None] = []
    for programs in held:
        if programs is None:
            return [None] * len(held)
        try:
            out.append(programs.timed(repeats))
        except RuntimeError as err:
            log.warning("a region's second timing failed (the first timings stand): %s: %s", type(err).__name__,
                        err)
            return [None] * len(held)
    return out


def _faster(first: ProgramRuns, again: ProgramRuns | None) -> ProgramRuns:
    """Each program's faster time of two timings (noise on a device only slows a program down)."""
    if again is None:
        return first

    def least(a: float | None, b: float | None) -> float | None:
        return a if b is None else b if a is None else min(a, b)

    return attrs.evolve(first, forward=min(first.forward, again.forward), backward=min(first.backward, again.backward),
                        backward_input=least(first.backward_input, again.backward_input),
                        backward_weight=least(first.backward_weight, again.backward_weight))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _split_shares(ran: ProgramRuns, fused_sum: float, b_sum: float, w_sum: float) -> tuple[float, float]:
    """Factors on a region's fused backward ratio that give B's and W's ops the seconds their own programs ran
    (`program_seconds(split=True)`), each a share of the fused backward's measured seconds: B's program over the
    fused one's, and W's. The whole model's calibrated ratio cannot tell B from W, and a compiler speeds them
    unevenly (a Llama's inductor-compiled block stages ran W 1.45-1.94 x and B 0.72-0.85 x what one ratio gave
    them, GPT's W 0.90-0.98 and B 0.96-1.06: 4 x H100, session 21's start-up measured scales); and apart they
    cost more than fused (a Llama's B + W 1.04-1.07 x its fused backward, 4 x H100, 2026-11-27), which a
    schedule that splits them pays while one that fuses them does not (it takes `Span.backward`). (1, 1) where
    a part is empty (the first region's B: no input grads) or was not measured."""
    b_run, w_run, fused_run = ran.backward_input, ran.backward_weight, ran.backward
    if b_run is None or w_run is None or min(b_run, w_run, fused_run, b_sum, w_sum, fused_sum) <= 0:
        return 1.0, 1.0
    return b_run / fused_run * fused_sum / b_sum, w_run / fused_run * fused_sum / w_sum


def _normalised(runs: Sequence[tuple[float, ...]]) -> list[Span]:
    """Each region's forward and backward seconds over its ops' sums, scaled so their means weighted by the
    regions' ops' sums are 1; B's and W's ratios are the backward's times the region's `_split_shares` (its
    7th and 8th numbers; 1 where a run has none), and the whole backward's (`Span.backward`) is the backward's."""
    f = [run[4] / run[2] if run[2] > 0 else 1.0 for run in runs]
    b = [run[5] / run[3] if run[3] > 0 else 1.0 for run in runs]
    f_mean = _weighted_mean(f, [r[2] for r in runs])
    b_mean = _weighted_mean(b, [r[3] for r in runs])
    shares = [tuple(run[6:8]) if len(run) >= 8 else (1.0, 1.0) for run in runs]
    return [Span(int(run[0]), int(run[1]), fr / f_mean, br * kb / b_mean, br * kw / b_mean, br / b_mean)
            for run, fr, br, (kb, kw) in zip(runs, f, b, shares)]


def _weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    total = sum(weights)
    mean = sum(v * w for v, w in zip(values, weights)) / total if total > 0 else 1.0
    return mean if mean > 0 else 1.0
