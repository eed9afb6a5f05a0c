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
from typing import Any, Mapping, Sequence

import attrs
import torch

import ir

from .blocks import crossing_bytes, module_cuts
from .calibration import Calibration, ProgramCompiler, signature
from .measured import MeasuredScale, Span, batch_key
from .pieces import piece_scale
from .timed import timed_stages

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
        level = False if name == "fx" else "cheap"
        found, table = region_scale(g, device, table, inputs, level=level, compile_program=compiler)
        if found is not None:  # each region's ratio spread over the kinds of block it holds
            found, table = piece_scale(g, device, found, table, inputs, level=level, compile_program=compiler)
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

    def flowing(stage: ir.Stage, values: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        return [inputs[i] for i in (*stage.param_ids, *stage.batch_ids)] + [values[v] for v in stage.acts_in]

    runs, cal = timed_stages(ir.split(g, cuts), device, cal, flowing, level=level, repeats=repeats,
                             compile_program=compile_program, what="region scales")
    if runs is None:
        return None, cal
    found = MeasuredScale(len(g.eqns), _normalised(runs), batch_key(g))
    log.info("calibration: regions run %s their ops' calibrated sum, over the model's mean", found)
    return found, cal


def _normalised(runs: Sequence[tuple[Any, ...]]) -> list[Span]:
    """Each region's forward and backward seconds over its ops' sums, scaled so their means weighted by the
    regions' ops' sums are 1; B's and W's ratios are the backward's times the region's `timed._split_shares` (its
    7th and 8th numbers; 1 where a run has none or they are None), and the whole backward's (`Span.backward`) is
    the backward's."""
    f = [run[4] / run[2] if run[2] > 0 else 1.0 for run in runs]
    b = [run[5] / run[3] if run[3] > 0 else 1.0 for run in runs]
    f_mean = _weighted_mean(f, [r[2] for r in runs])
    b_mean = _weighted_mean(b, [r[3] for r in runs])
    shares = [tuple(run[6:8]) if len(run) >= 8 and run[6] is not None else (1.0, 1.0) for run in runs]
    return [Span(int(run[0]), int(run[1]), fr / f_mean, br * kb / b_mean, br * kw / b_mean, br / b_mean)
            for run, fr, br, (kb, kw) in zip(runs, f, b, shares)]


def _weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    total = sum(weights)
    mean = sum(v * w for v, w in zip(values, weights)) / total if total > 0 else 1.0
    return mean if mean > 0 else 1.0
