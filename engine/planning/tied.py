"""Measured stage ratios tied over alike blocks: one ratio per kind of block, fitted to every measured stage.

A rebalance measures each stage's programs and feeds back measured / planned per stage
(`execution.profile.measured_scale`). Spread over a stage's equations as they are, those ratios move with the
equations when the split moves: on the Llama at p = 4 (4 x H100, inductor, session 22) the stage holding two
blocks and an attention ran 0.91 x its plan and the one after it 1.08 x, because the op costs split a block's
time between its attention and its MLP wrongly (55 / 45 where the programs ran 39 / 61). The re-split carried
0.91 onto the blocks it moved and predicted stages of two whole blocks at 1.34 and 1.48 ms, which both ran
1.47-1.50; its busiest rank came out 7.8 % over the mean.

Here the graph is cut where the splitter may cut (module boundaries and the cheap cuts inside modules,
`blocks.module_cuts` and `inner_cuts`), and pieces whose equations have equal op signatures are one **kind**: a
Llama's attention halves are one kind, its MLP halves another, the embedding and the head each their own. Per
pass (F, B, W and the whole backward) one ratio per kind is fitted by least squares so that each measured
stage's weighted mean of its equations' ratios meets the stage's measured ratio (weighed by each equation's
forward seconds times its region ratio: `CostModel.stage_scale` weighs the combined region-and-measured ratios
by forward seconds alone, and the plan the stages were measured against carried the region ratios), with a small
ridge towards the stages' mean ratio where the stages do not tell two kinds apart. Each equation then takes its
kind's ratio times its stage's residual (measured over fitted), so the measured cuts cost again exactly what they
ran; a stage its kinds miss by more than RESIDUAL (a slow device under it, say) keeps its own ratio (`tie`).
Where the stages just determine the kinds (a p = 4 Llama: the end stages hold the embedding and the head alone,
two middle ones pin attention and MLP) every residual is 1 and a stage's noise goes into its kinds' ratios: with
+-5 % noise a stage, a helper's simulation put the worst stage of a re-split 18 % off (12 % untied; 3.6 % against
6.8 % on average).

Offline, from the measured stage ratios of two launches of the Llama at p = 4 (`benchmarks/NOTES.md`, session
23), each re-split's stage forwards ran 0.80-1.09 x (session 22) and 0.88-1.12 x (session 23, call 2) their
prediction untied, and 0.93-1.00 x and 0.95-0.99 x tied (the offline planner's level sits a few % off the GPU's:
the spread within a launch is what the split balances on).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import attrs
import torch

import ir

from .blocks import crossing_bytes, inner_cuts, module_cuts
from .calibration import signature
from .measured import MeasuredScale, Span, spans_of
from .op_costs import CostModel

RIDGE = 1e-4  # pulls a kind the stages do not pin down towards their mean ratio
BOUNDS = (0.2, 5.0)  # a fitted kind ratio outside these is a fit of noise: clipped (an equation's ratio is its
# kind's times its stage's residual, so within BOUNDS widened by RESIDUAL)
RESIDUAL = 0.10  # a stage its kinds miss by more keeps its own ratio on its equations (a slow device, say)


def block_pieces(g: ir.Graph) -> list[tuple[int, int, int]]:
    """The pieces of `g` between the splitter's candidate cuts, in order, as (kind, start, stop): a piece's kind is
    the index of the first piece whose equations have the same op signatures."""
    cross = crossing_bytes(g)
    cuts = module_cuts(g, cross)
    bounds = [0, *sorted(set(cuts) | set(inner_cuts(cross, cuts))), len(g.eqns)]
    seen: dict[tuple[str, ...], int] = {}
    return [(seen.setdefault(tuple(signature(e) for e in g.eqns[start:stop]), len(seen)), start, stop)
            for start, stop in zip(bounds, bounds[1:])]


def block_kinds(g: ir.Graph) -> list[int]:
    """Each equation's kind: that of the piece it lies in (`block_pieces`)."""
    return [kind for kind, start, stop in block_pieces(g) for _ in range(start, stop)]


def tied_model(model: CostModel, graphs: Iterable[ir.Graph]) -> CostModel:
    """`model`, its per-stage measured scale (`MeasuredScale.per_stage`) tied on the graph of `graphs` it was
    measured on: fitted against the stage times the plan was costed with (the forward seconds times the region
    scale of each pass, as `CostModel.stage_scale` weighs them)."""
    scale = model.measured
    if scale is None or not scale.per_stage:
        return model
    for g in graphs:
        if scale.matches(g):
            return attrs.evolve(model, measured=tie(scale, block_kinds(g), _weights(model, g)))
    return model


def _weights(model: CostModel, g: ir.Graph) -> list[list[float]]:
    """Per pass (F, B, W, whole backward), each equation's forward seconds times its region ratio."""
    times = model.eqn_times(g)
    region = model.calibration.region if model.calibration is not None else None
    n = len(g.eqns)
    ratios = region.per_eqn(n) if region is not None and region.matches(g) else None
    fused = region.fused_per_eqn(n) if region is not None and region.matches(g) else None
    if ratios is None or fused is None:
        return [list(times)] * 4
    return [[t * r for t, r in zip(times, part)] for part in (*ratios, fused)]


def tie(scale: MeasuredScale, kinds: Sequence[int], weights: Sequence[Sequence[float]]) -> MeasuredScale:
    """`scale`'s per-stage ratios refitted per kind of equation (`kinds`, from `block_kinds`), each pass (F, B, W,
    whole backward) weighted by its `weights` (per equation); `scale` itself where no kind lies in two measured
    stages (nothing to tie). Each equation takes its kind's fitted ratio times its stage's residual (the stage's
    measured ratio over the fit's): every measured stage costs again exactly what it ran, and a moved piece
    carries its kind's ratio and its old stage's residual, not its old stage's mix. A stage whose residual is off 1
    by more than RESIDUAL keeps its own ratio on its equations (alike blocks that ran unalike: a slow device under
    it), the stage's to give away; a slow stage whose mix is its own cannot be told from its kinds' costs (a kind
    only it holds takes the slowdown), and the re-split that moves is measured before it is kept
    (`execution.rebalance`). The first stage's B and W are left out of their fits (it has no B, and its W program
    is its whole backward, costed at the whole backward's ratio: `stage_costs._scales`); pieces it gives away
    take the fitted B and W ratios of their kinds."""
    n = scale.num_eqns
    if len(kinds) != n or not _shared(scale.spans, kinds):
        return scale
    later = [s for s in scale.spans if s.start > 0]
    per_pass = [(scale.spans, lambda s: s.forward), (later, lambda s: s.backward_input),
                (later, lambda s: s.backward_weight), (scale.spans, lambda s: s.fused)]
    columns = [_pass(scale, spans, kinds, w, ratio) for (spans, ratio), w in zip(per_pass, weights)]
    return MeasuredScale(n, spans_of(columns), scale.batch)


def _shared(spans: Sequence[Span], kinds: Sequence[int]) -> set[int]:
    """The kinds that lie in at least two of `spans`."""
    seen: dict[int, int] = {}
    for s in spans:
        for k in set(kinds[s.start:s.stop]):
            seen[k] = seen.get(k, 0) + 1
    return {k for k, count in seen.items() if count >= 2}


def _pass(scale: MeasuredScale, spans: Sequence[Span], kinds: Sequence[int], weights: Sequence[float],
          ratio: Callable[[Span], float]) -> list[float]:
    """One pass's ratio per equation (`tie`): the kinds of `spans` fitted, each stage's residual on its equations;
    a stage whose residual is off 1 by more than RESIDUAL keeps its own ratio (its kinds do not explain it), the
    stages left out of the fit (the first, for B and W) take the fitted ratios where they have them, and 1
    outside every stage."""
    out = [1.0] * scale.num_eqns
    for s in scale.spans:
        out[s.start:s.stop] = [ratio(s)] * (s.stop - s.start)
    present = sorted({k for s in spans for k in kinds[s.start:s.stop]})
    rows = [_shares(s, kinds, weights, present) for s in spans]
    fitting = [(row, ratio(s)) for s, row in zip(spans, rows) if row is not None]
    if not present or not fitting:
        return out
    fitted = _fit([row for row, _ in fitting], [y for _, y in fitting])
    column = {k: j for j, k in enumerate(present)}
    residuals = {(s.start, s.stop): ratio(s) / sum(x * r for x, r in zip(row, fitted))
                 for s, row in zip(spans, rows) if row is not None}
    for s in scale.spans:
        residual = residuals.get((s.start, s.stop), None if s in spans else 1.0)
        if residual is None or abs(residual - 1) > RESIDUAL:
            continue
        for i in range(s.start, s.stop):
            j = column.get(kinds[i])
            if j is not None:
                out[i] = fitted[j] * residual
    return out


def _shares(span: Span, kinds: Sequence[int], weights: Sequence[float], present: Sequence[int]) -> list[float] | None:
    """Each kind of `present`'s share of the span's weighted equations; None if the span weighs nothing."""
    column = {k: j for j, k in enumerate(present)}
    row = [0.0] * len(present)
    for i in range(span.start, span.stop):
        j = column.get(kinds[i])
        if j is not None:
            row[j] += max(weights[i], 0.0)
    total = sum(row)
    return [x / total for x in row] if total > 0 else None


def _fit(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Per kind, the ratio whose stage-weighted means best meet `y` (least squares, a ridge to their mean),
    clipped to BOUNDS."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(list(y), dtype=torch.float64)
    lhs = a.T @ a + RIDGE * torch.eye(a.shape[1], dtype=torch.float64)
    fitted = torch.linalg.solve(lhs, a.T @ b + RIDGE * float(b.mean()))
    return [min(max(float(x), BOUNDS[0]), BOUNDS[1]) for x in fitted]
