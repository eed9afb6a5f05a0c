"""Coarsening a graph into blocks: contiguous equation ranges cut only where few bytes cross.

Candidate cuts sit between modules (parameter names up to their layer index: `blocks.3`), each at the
position of its gap with the fewest bytes crossing: between two transformer blocks that is the one
[b, s, d] residual. When the names give too few modules, local minima of the crossing profile are added.
Per block the costs the splitter reads are summed once (prefix sums make any range O(1)).
"""
from __future__ import annotations

import bisect
import itertools
from typing import Sequence

import attrs

import ir

from .op_costs import CostModel, backward_estimates
from ..names import module_key

MAX_BLOCKS = 128


@attrs.frozen
class Blocks:
    """K blocks of a graph: block k is equations [bounds[k], bounds[k+1]). Costs per block, seconds/bytes."""

    bounds: tuple[int, ...]
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    flops: tuple[int, ...]
    saved: tuple[int, ...]                  # bytes kept for B/W per microbatch: estimate, or exact_blocks
    params: tuple[frozenset[int], ...]      # graph input indices of the params each block reads
    param_bytes: tuple[int, ...]            # per graph param
    cut_bytes: tuple[int, ...]              # bytes crossing each bound (0 at both ends)
    names: tuple[str, ...]                  # per graph param

    @property
    def num_blocks(self) -> int:
        return len(self.bounds) - 1

    def time(self, k: int) -> float:
        return self.forward[k] + self.backward_input[k] + self.backward_weight[k]


def crossing_bytes(g: ir.Graph) -> list[int]:
    """bytes[i]: bytes of values defined before equation i and read at or after it (carried values count)."""
    n = len(g.eqns)
    delta = [0] * (n + 2)
    prod = g.producers()
    for v, last in g.last_use().items():
        if v in prod and last > prod[v]:
            delta[prod[v] + 1] += v.aval.nbytes
            delta[last + 1] -= v.aval.nbytes
    return list(itertools.accumulate(delta[: n + 1]))


def eqn_modules(g: ir.Graph) -> list[frozenset[str]]:
    """Per equation, the modules whose parameters it reads (directly or through parameter-only ops)."""
    origin: dict[ir.Var, frozenset[str]] = {v: frozenset({module_key(n)}) for v, n in zip(g.params, g.input_names)}
    tags = []
    for e in g.eqns:
        ins = e.inputs
        if ins and all(u in origin for u in ins):  # a view or cast of weights belongs to its reader
            merged = frozenset().union(*(origin[u] for u in ins))
            origin.update({v: merged for v in e.out_vars})
            tags.append(frozenset())
        else:
            tags.append(frozenset().union(*(origin[u] for u in ins if u in origin)))
    return tags


def module_cuts(g: ir.Graph, cross: Sequence[int]) -> list[int]:
    """A cut between each pair of consecutive modules, where the fewest bytes cross in the gap."""
    cuts: list[int] = []
    current: frozenset[str] = frozenset()
    last = -1
    for i, tag in enumerate(eqn_modules(g)):
        if not tag:
            continue
        if current and not tag & current:
            gap = range(last + 1, i + 1)
            cuts.append(min(gap, key=lambda p: (cross[p], -p)))
        current, last = tag, i
    return [c for c in dict.fromkeys(cuts) if 0 < c < len(g.eqns)]


def _minima(cross: Sequence[int], taken: set[int]) -> list[int]:
    n = len(cross) - 1
    return [p for p in range(1, n) if p not in taken and cross[p] <= cross[p - 1] and cross[p] <= cross[p + 1]]


def inner_cuts(cross: Sequence[int], module: Sequence[int]) -> list[int]:
    """Cuts inside modules crossing no more bytes than the module cuts around them (in a transformer
    block: after the attention's residual add, where only the residual stream crosses)."""
    fences = sorted(module)
    out = []
    for p in _minima(cross, set(fences)):
        k = bisect.bisect(fences, p)
        around = [cross[q] for q in fences[max(k - 1, 0):k + 1]]
        if around and cross[p] <= max(around):
            out.append(p)
    return out


def profile_cuts(cross: Sequence[int], taken: set[int], wanted: int) -> list[int]:
    """Up to `wanted` more cuts at local minima of the crossing profile, fewest bytes first."""
    n = len(cross) - 1
    minima = _minima(cross, taken)
    others = [p for p in range(1, n) if p not in taken and p not in set(minima)]
    ranked = sorted(minima, key=lambda p: (cross[p], p)) + sorted(others, key=lambda p: (cross[p], p))
    return ranked[:wanted]


def _merge_to(bounds: list[int], times: Sequence[float], limit: int) -> list[int]:
    """Drop inner bounds, the one joining the cheapest neighbours first, until at most `limit` blocks."""
    prefix = list(itertools.accumulate(times, initial=0.0))
    while len(bounds) - 1 > limit:
        k = min(range(1, len(bounds) - 1), key=lambda k: prefix[bounds[k + 1]] - prefix[bounds[k - 1]])
        del bounds[k]
    return bounds


def _sums(values: Sequence[float], bounds: Sequence[int]) -> tuple[float, ...]:
    prefix = list(itertools.accumulate(values, initial=0))
    return tuple(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))


def _block_params(reads: Sequence[frozenset[int]], bounds: Sequence[int]) -> tuple[frozenset[int], ...]:
    """The params each block reads (graph input indices)."""
    return tuple(frozenset().union(*reads[a:b]) for a, b in zip(bounds, bounds[1:]))


def _saved_estimate(g: ir.Graph, times: Sequence[float]) -> list[int]:
    """Output bytes of each costly equation with a floating result that stage autodiff would not
    recompute (views, pointwise ops, layer norms and copies are redone in the backward)."""
    return [sum(v.aval.nbytes for v in e.out_vars if v.aval.dtype.is_floating_point)
            if t and not ir.recomputable(e) else 0 for e, t in zip(g.eqns, times)]


def _weighted(weights: Sequence[float], values: Sequence[float]) -> float:
    """The mean of `values` weighted by `weights` (equally where they sum to 0)."""
    total = sum(weights)
    if total <= 0:
        return sum(values) / len(values) if values else 1.0
    return sum(w * v for w, v in zip(weights, values)) / total


def coarsen(g: ir.Graph, model: CostModel, *, fine: bool = False, min_blocks: int = 1,
            max_blocks: int = MAX_BLOCKS) -> Blocks:
    """Blocks of `g` with their costs: module boundaries (with `fine`, also the cheap cuts inside
    modules), plus profile minima until there are `min_blocks` blocks."""
    n = len(g.eqns)
    cross = crossing_bytes(g)
    times = model.eqn_times(g)
    cuts = module_cuts(g, cross)
    if fine:
        cuts += inner_cuts(cross, cuts)
    if len(cuts) + 1 < min_blocks:
        cuts += profile_cuts(cross, set(cuts), min_blocks - 1 - len(cuts))
    bounds = _merge_to([0, *sorted(cuts), n], times, max(max_blocks, 1))
    b_times, w_times = backward_estimates(g, times)
    back = [model.backward_ratio if model.calibrated(e) else 1.0 for e in g.eqns]  # calibrated: the backward scale
    b_times, w_times = [t * x for t, x in zip(b_times, back)], [t * x for t, x in zip(w_times, back)]
    scales = model.eqn_scales(g)  # the stage programs' measured / planned seconds, where they were measured
    acc_scale = [1.0] * (len(bounds) - 1)
    if scales is not None:
        acc_scale = [_weighted(times[i:j], scales[2][i:j]) for i, j in zip(bounds, bounds[1:])]
        times, b_times, w_times = ([t * x for t, x in zip(ts, xs)] for ts, xs in zip((times, b_times, w_times), scales))
    param_pos = {v: i for i, v in enumerate(g.params)}
    reads = [frozenset(param_pos[u] for u in e.inputs if u in param_pos) for e in g.eqns]
    return Blocks(
        bounds=tuple(bounds),
        forward=_sums(times, bounds),
        backward_input=_sums(b_times, bounds),
        backward_weight=tuple(w + x * model.params_accumulate_time(g, ps) for w, ps, x in
                              zip(_sums(w_times, bounds), _block_params(reads, bounds), acc_scale)),
        flops=tuple(int(x) for x in _sums([ir.eqn_cost(e).flops for e in g.eqns], bounds)),
        saved=tuple(int(x) for x in _sums(_saved_estimate(g, times), bounds)),
        params=_block_params(reads, bounds),
        param_bytes=tuple(v.aval.nbytes for v in g.params),
        cut_bytes=tuple(0 if p in (0, n) else cross[p] for p in bounds),
        names=tuple(g.input_names[: g.num_params]),
    )
