"""Stage programs as measured on the device, fed back into the cost model: a scale per span of equations.

The planner costs equations from calibrated (or roofline) op times with one scale for the whole model, but a
compiler changes stages unevenly: inductor fuses a head's loss into its matmul and halves it while a block's
attention hardly moves (GPT on 4 x H200, 2026-11-26: the head-and-loss stage planned at 1.14-1.41 x its
measured programs, the block stages under). `Step.profile_programs` measures every stage's F, B and W; their
ratios to the plan's own F, B, W become a `MeasuredScale`: each equation of a measured stage takes its stage's
three ratios. A stage of a new split takes the mean of its equations' ratios weighted by their (unscaled)
forward times, so the splitter moves equations off a stage that ran slower than planned
(`engine.execution.rebalance`).
"""
from __future__ import annotations

from typing import Sequence

import attrs

import ir


@attrs.frozen
class Span:
    """Equations [start, stop) of the microbatch graph, whose F, B and W ran `forward`, `backward_input` and
    `backward_weight` times their planned seconds, and their whole backward as one program `backward` times
    (None: not measured apart, taken as W's). B and W split one backward unevenly (inductor speeds B's pointwise
    work more than W's matmuls), so a stage with no B, whose W graph is its whole backward (the first: nothing
    upstream takes its input grads), takes `backward`, not W's ratio."""

    start: int
    stop: int
    forward: float
    backward_input: float
    backward_weight: float
    backward: float | None = None

    @property
    def fused(self) -> float:
        return self.backward_weight if self.backward is None else self.backward

    def __str__(self) -> str:
        fused = "" if self.backward is None else f" BW x{self.backward:.2f}"
        return (f"eqns {self.start}:{self.stop} F x{self.forward:.2f} B x{self.backward_input:.2f} "
                f"W x{self.backward_weight:.2f}{fused}")


def batch_key(g: ir.Graph) -> str:
    """What tells one microbatch graph of a model from another with as many equations: its batch leaves'
    shapes and dtypes (another microbatch size)."""
    return ";".join(f"{tuple(v.aval.shape)}:{v.aval.dtype}" for v in g.batch)


@attrs.frozen
class MeasuredScale:
    """Per-span ratios of measured to planned seconds, for the microbatch graph of `num_eqns` equations that
    was measured (another microbatch size makes another graph: the scale then does not apply); `batch` is that
    graph's `batch_key` where it was recorded ("" for a scale made for one plan's graph: its equation count is
    checked alone). `per_stage`: the spans are a plan's stages as measured, which the planner refits per kind of
    block before it costs with them (`engine.planning.tied`)."""

    num_eqns: int
    spans: tuple[Span, ...] = attrs.field(converter=tuple)
    batch: str = ""
    per_stage: bool = False

    def matches(self, g: ir.Graph) -> bool:
        """Whether this scale was measured on graph `g` (or one like it)."""
        return self.num_eqns == len(g.eqns) and (not self.batch or self.batch == batch_key(g))

    def per_eqn(self, num_eqns: int) -> tuple[list[float], list[float], list[float]] | None:
        """The F, B, W ratio of each equation of a graph of `num_eqns` equations (1 outside every span), or None
        if this scale was measured on another graph."""
        if num_eqns != self.num_eqns:
            return None
        f, b, w = [1.0] * num_eqns, [1.0] * num_eqns, [1.0] * num_eqns
        for s in self.spans:
            for i in range(s.start, min(s.stop, num_eqns)):
                f[i], b[i], w[i] = s.forward, s.backward_input, s.backward_weight
        return f, b, w

    def fused_per_eqn(self, num_eqns: int) -> list[float] | None:
        """Each equation's whole-backward ratio (`Span.fused`; 1 outside every span), None for another graph."""
        if num_eqns != self.num_eqns:
            return None
        out = [1.0] * num_eqns
        for s in self.spans:
            out[s.start:min(s.stop, num_eqns)] = [s.fused] * (min(s.stop, num_eqns) - s.start)
        return out

    def columns(self) -> tuple[list[float], list[float], list[float], list[float]]:
        """Each equation's F, B, W and whole-backward ratio (1 outside every span)."""
        ratios, fused = self.per_eqn(self.num_eqns), self.fused_per_eqn(self.num_eqns)
        assert ratios is not None and fused is not None
        return (*ratios, fused)

    def fused_of_range(self, times: Sequence[float], start: int, stop: int, num_eqns: int) -> float:
        """The whole-backward ratio of equations [start, stop), weighted as `of_range` weighs."""
        ratios = self.fused_per_eqn(num_eqns)
        if ratios is None or stop <= start:
            return 1.0
        weights = list(times)
        total = sum(weights)
        if total <= 0:
            weights, total = [1.0] * (stop - start), float(stop - start)
        return sum(wt * r for wt, r in zip(weights, ratios[start:stop])) / total

    def of_range(self, times: Sequence[float], start: int, stop: int, num_eqns: int) -> tuple[float, float, float]:
        """The F, B, W ratios of equations [start, stop) of a graph of `num_eqns`, weighted by `times` (those
        equations' unscaled forward seconds; equally where they sum to 0); (1, 1, 1) for another graph."""
        ratios = self.per_eqn(num_eqns)
        if ratios is None or stop <= start:
            return 1.0, 1.0, 1.0
        weights = list(times)
        total = sum(weights)
        if total <= 0:
            weights, total = [1.0] * (stop - start), float(stop - start)
        f, b, w = (sum(wt * r for wt, r in zip(weights, part[start:stop])) / total for part in ratios)
        return f, b, w

    def __str__(self) -> str:
        return "; ".join(map(str, self.spans))


def combined(first: MeasuredScale | None, then: MeasuredScale | None) -> MeasuredScale | None:
    """The scale of costs scaled by `first` and then by `then` (each equation's ratios multiplied), as spans of
    equal ratios: a calibration's region scales with a rebalance's stage ratios, which were measured against
    plans costed with the regions. Either alone where the other is None; both must be of one graph (the cost
    model checks each against the graph it costs, `MeasuredScale.matches`)."""
    if first is None or then is None:
        return then if then is not None else first
    if first.num_eqns != then.num_eqns:
        raise ValueError(f"scales of graphs of {first.num_eqns} and {then.num_eqns} equations do not combine")
    n = first.num_eqns
    a, b = first.columns(), then.columns()
    return MeasuredScale(n, spans_of([[x * y for x, y in zip(p, q)] for p, q in zip(a, b)]), first.batch or then.batch)


def spans_of(columns: Sequence[Sequence[float]]) -> list[Span]:
    """Spans of equal ratios from per-equation columns F, B, W and whole backward (`MeasuredScale.columns`)."""
    spans: list[Span] = []
    for i, r in enumerate(zip(*columns)):
        last = spans[-1] if spans else None
        if last is not None and (last.forward, last.backward_input, last.backward_weight, last.backward) == r:
            spans[-1] = attrs.evolve(last, stop=i + 1)
        else:
            spans.append(Span(i, i + 1, *r))
    return spans
