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
stage's weighted mean of its equations' ratios (as `MeasuredScale.of_range` weighs them: the equations'
forward seconds under the scale the plan was costed with) meets the stage's measured ratio, with a small ridge
towards the stages' mean ratio where the stages do not tell two kinds apart. Offline on session 22's
measurements (`tests/engine/test_tied.py` holds a small case) the re-split's stage forwards were predicted
within 0.99-1.08 of what they ran, against 0.92-1.25 untied.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import attrs
import torch

import ir

from .blocks import crossing_bytes, inner_cuts, module_cuts
from .calibration import signature
from .measured import MeasuredScale, Span
from .op_costs import CostModel

RIDGE = 1e-4  # pulls a kind the stages do not pin down towards their mean ratio
BOUNDS = (0.2, 5.0)  # a fitted ratio outside these is a fit of noise: clipped
TOLERANCE = 0.05  # a pass whose fit misses a stage by more keeps the stages' own ratios


def block_kinds(g: ir.Graph) -> list[int]:
    """Each equation's kind: the index of the first piece, between the splitter's candidate cuts, whose
    equations have the same op signatures as the piece it lies in."""
    cross = crossing_bytes(g)
    cuts = module_cuts(g, cross)
    bounds = [0, *sorted(set(cuts) | set(inner_cuts(cross, cuts))), len(g.eqns)]
    seen: dict[tuple[str, ...], int] = {}
    kinds: list[int] = []
    for start, stop in zip(bounds, bounds[1:]):
        key = tuple(signature(e) for e in g.eqns[start:stop])
        kinds += [seen.setdefault(key, len(seen))] * (stop - start)
    return kinds


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
    """`scale`'s per-stage ratios refitted as one ratio per kind of equation (`kinds`, from `block_kinds`), each
    pass (F, B, W, whole backward) weighted by its `weights` (per equation); `scale` itself where no kind
    repeats (nothing to tie). A pass whose fit misses a stage's measured ratio by more than TOLERANCE keeps the
    stages' own ratios: alike blocks that ran unalike there (a slow device under one stage, not the op costs'
    split of a block) are the stage's to give away. The first stage's B and W are left out of theirs: it has
    no B, and its W program is its whole backward, costed at the whole backward's ratio
    (`stage_costs._scales`)."""
    n = scale.num_eqns
    if len(kinds) != n or not scale.spans or max(kinds.count(k) for k in set(kinds)) < 2:
        return scale
    later = [s for s in scale.spans if s.start > 0]
    per_pass = [(scale.spans, lambda s: s.forward), (later, lambda s: s.backward_input),
                (later, lambda s: s.backward_weight), (scale.spans, lambda s: s.fused)]
    columns = [_pass(scale, spans, kinds, w, ratio) for (spans, ratio), w in zip(per_pass, weights)]
    out: list[Span] = []
    for i, ratios in enumerate(zip(*columns)):
        last = out[-1] if out else None
        if last is not None and (last.forward, last.backward_input, last.backward_weight, last.backward) == ratios:
            out[-1] = attrs.evolve(last, stop=i + 1)
        else:
            out.append(Span(i, i + 1, *ratios))
    return MeasuredScale(n, out, scale.batch)


def _pass(scale: MeasuredScale, spans: Sequence[Span], kinds: Sequence[int], weights: Sequence[float],
          ratio: Callable[[Span], float]) -> list[float]:
    """One pass's ratio per equation: fitted per kind where the fit meets every stage within TOLERANCE, else
    each stage's own (1 outside every stage)."""
    own = [1.0] * scale.num_eqns
    for s in scale.spans:
        own[s.start:s.stop] = [ratio(s)] * (s.stop - s.start)
    if not spans:
        return own
    rows = _rows(spans, kinds, weights)
    y = torch.tensor([ratio(s) for s in spans], dtype=torch.float64)
    fitted = _fit(rows, y)
    met = bool(((rows @ torch.tensor(fitted, dtype=torch.float64) - y).abs() <= TOLERANCE * y).all())
    return [fitted[k] for k in kinds] if met else own


def _rows(spans: Sequence[Span], kinds: Sequence[int], weights: Sequence[float]) -> torch.Tensor:
    """Per stage, each kind's share of its weighted equations."""
    rows = torch.zeros(len(spans), max(kinds) + 1, dtype=torch.float64)
    for r, s in enumerate(spans):
        for i in range(s.start, s.stop):
            rows[r, kinds[i]] += max(weights[i], 0.0)
        total = rows[r].sum()
        if total > 0:
            rows[r] /= total
    return rows


def _fit(rows: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Per kind, the ratio whose stage-weighted means best meet `y` (least squares, a ridge to their mean),
    clipped to BOUNDS."""
    num = rows.shape[1]
    lhs = rows.T @ rows + RIDGE * torch.eye(num, dtype=torch.float64)
    fitted = torch.linalg.solve(lhs, rows.T @ y + RIDGE * float(y.mean()))
    return [min(max(float(x), BOUNDS[0]), BOUNDS[1]) for x in fitted]
