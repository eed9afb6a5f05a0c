"""The splitter: an exact dynamic programme over blocks that minimises the slowest stage within memory.

Stage k takes blocks [b_k, b_{k+1}); its time is its blocks' F+B+W plus sending across both its cuts;
its peak is its static bytes plus its microbatches in flight (from the schedule) times the activations
each keeps. `partition` finds the contiguous split whose slowest stage is fastest among those where every
stage fits its budget, in O(S K^2) for K blocks and S stages: no tracing here. The splitter's own calls
(`split_costs`, `stage_costs.split_recompute`) hand it whole K x K grids of stage times and fits per
stage (`grid=True`), so the O(S K^2) work is numpy's and a search over many layouts of a 128-block
model takes milliseconds a split, not seconds; the grids hold the very sums the scalar path computes,
in the same order, so the split found is the same to the bit.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import attrs
import numpy as np

from ..errors import SplitError
from ..units import nbytes
from .memory import MemoryModel

FIX = ("make it fit with more pipeline stages, activation recomputation, or a smaller microbatch "
       "(more microbatches per step); or raise memory_limit")


@attrs.frozen
class Partition:
    """Stage k holds blocks [bounds[k], bounds[k+1]); `bottleneck` is the slowest stage's value."""

    bounds: tuple[int, ...]
    bottleneck: float

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1


def partition(num_blocks: int, num_stages: int, cost: Callable[[int, Any, Any], Any],
              fits: Callable[[int, Any, Any], Any] | None = None, *, grid: bool = False) -> Partition | None:
    """The split of blocks 0..K-1 into `num_stages` non-empty ranges minimising the largest
    cost(stage, i, j) of its stages, with fits(stage, i, j) true for every stage; None when none fits.
    With `grid`, cost and fits take index arrays (i a column, j a row, numpy broadcasting) and return
    the (K+1) x (K+1) grid of every range's value for that stage at once."""
    k_max, s_max = num_blocks, num_stages
    if s_max < 1 or s_max > k_max:
        return None
    if grid:
        return _partition_grid(k_max, s_max, cost, fits)
    inf = float("inf")
    best = [[inf] * (k_max + 1) for _ in range(s_max + 1)]
    arg = [[-1] * (k_max + 1) for _ in range(s_max + 1)]
    best[0][0] = -inf
    for s in range(1, s_max + 1):
        for j in range(s, k_max - (s_max - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf or (fits is not None and not fits(s - 1, i, j)):
                    continue
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], arg[s][j] = value, i
    return _backtrack(best, arg, k_max, s_max)


def _partition_grid(k_max: int, s_max: int, cost: Callable[[int, Any, Any], Any],
                    fits: Callable[[int, Any, Any], Any] | None) -> Partition | None:
    """`partition` on grids: the same recurrence, one stage at a time; ties go to the smallest i, as there."""
    inf = float("inf")
    i_idx, j_idx = np.arange(k_max + 1)[:, None], np.arange(k_max + 1)[None, :]
    allowed = i_idx < j_idx
    best = np.full((s_max + 1, k_max + 1), inf)
    arg = np.full((s_max + 1, k_max + 1), -1, dtype=np.int64)
    best[0, 0] = -inf
    for s in range(1, s_max + 1):
        prev = best[s - 1][:, None]
        ok = allowed & (prev != inf)
        if fits is not None:
            ok &= np.asarray(fits(s - 1, i_idx, j_idx), dtype=bool)
        value = np.where(ok, np.maximum(prev, np.asarray(cost(s - 1, i_idx, j_idx), dtype=np.float64)), inf)
        i = np.argmin(value, axis=0)  # the first minimum: the scalar loop's strict < keeps the first too
        low = value[i, np.arange(k_max + 1)]
        reach = (low < inf) & (j_idx[0] >= s) & (j_idx[0] <= k_max - (s_max - s))
        best[s] = np.where(reach, low, inf)
        arg[s] = np.where(reach, i, -1)
    return _backtrack(best.tolist(), arg.tolist(), k_max, s_max)


def _backtrack(best: Sequence[Sequence[float]], arg: Sequence[Sequence[int]], k_max: int, s_max: int
               ) -> Partition | None:
    if best[s_max][k_max] == float("inf"):
        return None
    bounds = [k_max]
    for s in range(s_max, 0, -1):
        bounds.append(int(arg[s][bounds[-1]]))
    return Partition(tuple(reversed(bounds)), float(best[s_max][k_max]))


@attrs.frozen
class BlockCosts:
    """What the splitter needs of each block and each bound, as plain numbers (seconds and bytes)."""

    time: tuple[float, ...]          # F+B+W per microbatch
    param_bytes: tuple[float, ...]   # bytes of the params it reads
    saved: tuple[float, ...]         # activation bytes kept per microbatch in flight
    cut_bytes: tuple[float, ...]     # K+1: bytes crossing each bound, 0 at both ends
    cut_time: tuple[float, ...]      # K+1: seconds to send them
    forward: tuple[float, ...] = ()  # F per microbatch, part of `time` (empty: taken as none)
    _time_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _param_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _saved_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _forward_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _arrays: dict[str, np.ndarray] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        forward = self.forward or (0.0,) * len(self.time)
        for name, values in (("_time_sum", self.time), ("_param_sum", self.param_bytes), ("_saved_sum", self.saved),
                             ("_forward_sum", forward)):
            object.__setattr__(self, name, tuple(itertools.accumulate(values, initial=0.0)))
        object.__setattr__(self, "_arrays", {name: np.asarray(getattr(self, name), dtype=np.float64) for name in
                                             ("_time_sum", "_param_sum", "_saved_sum", "_forward_sum", "cut_bytes",
                                              "cut_time")})

    def sums(self, i: Any) -> Callable[[str], Any]:
        """The prefix sums and per-bound values by name: tuples for int indices, numpy arrays for index
        arrays (the grids `partition(grid=True)` takes); either way the same numbers."""
        if isinstance(i, np.ndarray):
            return self._arrays.__getitem__
        return lambda name: getattr(self, name)

    @property
    def num_blocks(self) -> int:
        return len(self.time)

    def stage_time(self, i: Any, j: Any) -> Any:
        """Seconds per microbatch of a stage of blocks [i, j): compute plus sends over its two cuts."""
        at = self.sums(i)
        t, c = at("_time_sum"), at("cut_time")
        return t[j] - t[i] + c[i] + c[j]

    def stage_ahead(self, i: Any, j: Any, *, backward: bool) -> Any:
        """Seconds a stage of blocks [i, j) holds up the stages after it once a step: its forward and the send
        after it; with `backward`, its backward and the send before it as well (all of `stage_time`)."""
        if backward:
            return self.stage_time(i, j)
        at = self.sums(i)
        f, c = at("_forward_sum"), at("cut_time")
        return f[j] - f[i] + c[j]

    def stage_peak(self, i: Any, j: Any, live: int, memory: MemoryModel) -> Any:
        """Peak bytes of a stage of blocks [i, j) with `live` microbatches in flight."""
        at = self.sums(i)
        p, s, cut = at("_param_sum"), at("_saved_sum"), at("cut_bytes")
        m = memory.stage(param_bytes=p[j] - p[i], saved_bytes=s[j] - s[i], recv_bytes=cut[i], send_bytes=cut[j])
        return memory.peak(m, live)


def balance_ranks(bounds: Sequence[int], rank_of: Sequence[int], time: Callable[[int, Any, Any], Any],
                  fits: Callable[[int, Any, Any], Any] | None = None, *, slack: float = 0.0,
                  ahead: Callable[[int, Any, Any], Any] | None = None, microbatches: int = 1,
                  most: int = 100_000, rounds: int = 64) -> tuple[int, ...]:
    """`bounds` (a split, stage s on rank rank_of[s]) with its cuts moved so that the busiest rank is as little
    busy as it can be: a rank runs every stage it holds, so where a rank holds more than one (zbv's V, the
    interleaved schedules) the split that minimises the slowest stage (`partition`) can leave one rank a
    stage's difference busier than the rest (GPT zbv at p = 4 on 4 x H100's costs: rank 2 1.07 x the mean).
    Balancing one rank usually moves two or three cuts together (a lighter rank takes a block from its
    neighbour, which takes one from the busiest), so the cuts move jointly: every combination of each cut moved
    by at most w blocks (the largest w of 3, 2, 1 with at most `most` combinations), scored at once (numpy);
    with more cuts than that allows (11 and up), the best move of any two cuts by up to 2 blocks each; either
    again and again (at most `rounds` times) while one helps. Best: (the busiest rank's seconds, then the sum of
    squares of every rank's), each stage non-empty, fitting (`fits(s, i, j)`) and at most `slack` slower than
    the split's slowest stage (ranks balanced with no such bound made stages of 1 and 7 blocks, which
    simulated 8 % slower there: a long stage holds up every microbatch's flow; with 5 % the step simulated
    4 % faster); the original split wins its ties. `time(s, i, j)` and `fits` take index arrays (numpy
    broadcasting, as `partition(grid=True)`'s do).
    A rank's busy time is `microbatches` x its seconds a microbatch plus, with `ahead(s, i, j)` (seconds, index
    arrays too), what the stages before its first hold it up once a step: nothing reaches rank r before the
    first microbatch's forward has passed the stages ahead of it, and where no weight pass is left to fill the
    end, it also finishes their backward's chain early. On zbv's V at p = 4 that is F0 + F1 + F2 at the start
    of rank 3 (4.7 ms of GPT's 96.5 ms step on 4 x H100's costs), so balanced by work alone rank 3 set the
    step (`Candidates.balanced` passes both)."""
    b = np.asarray(bounds, dtype=np.int64)
    cuts = len(b) - 2
    if cuts <= 0:
        return tuple(int(x) for x in bounds)
    slowest = max(float(time(st, b[st], b[st + 1])) for st in range(len(b) - 1)) * (1 + slack + 1e-9)
    w = next((w for w in (3, 2, 1) if (2 * w + 1) ** cuts <= most), 0)
    busy = _Busy(rank_of, time, fits, slowest, ahead, microbatches)
    moves = _joint_moves(cuts, w) if w else _pair_moves(cuts, 2)
    for _ in range(rounds):
        moved = np.asarray(busy.best_move(b, moves), dtype=np.int64)
        if np.array_equal(moved, b):
            break
        b = moved
    return tuple(int(x) for x in b)


def _joint_moves(cuts: int, w: int) -> np.ndarray:
    """Every move of `cuts` cuts by -w..w blocks each, the smallest first (no move first)."""
    moves = np.asarray(list(itertools.product(range(-w, w + 1), repeat=cuts)), dtype=np.int64)
    return moves[np.argsort(np.abs(moves).sum(axis=1), kind="stable")]


def _pair_moves(cuts: int, w: int) -> np.ndarray:
    """No move, then every move of one or two of `cuts` cuts by -w..w blocks each."""
    rows = [np.zeros(cuts, dtype=np.int64)]
    steps = [d for d in range(-w, w + 1) if d]
    for c1, c2 in itertools.combinations_with_replacement(range(cuts), 2):
        for d1 in steps:
            for d2 in (steps if c1 != c2 else [0]):
                row = np.zeros(cuts, dtype=np.int64)
                row[c1] += d1
                row[c2] += d2
                rows.append(row)
    return np.stack(rows)


@attrs.frozen
class _Busy:
    """How busy each rank is under a split (`balance_ranks`'s score) and the best of a set of moves by it."""

    rank_of: Sequence[int]
    time: Callable[[int, Any, Any], Any]
    fits: Callable[[int, Any, Any], Any] | None
    slowest: float
    ahead: Callable[[int, Any, Any], Any] | None
    microbatches: int

    def best_move(self, b: np.ndarray, moves: np.ndarray) -> tuple[int, ...]:
        """The split of `b` moved by the best of `moves` (rows; the first is no move, and wins its ties)."""
        splits = np.concatenate([np.full((len(moves), 1), b[0]), b[1:-1] + moves, np.full((len(moves), 1), b[-1])],
                                axis=1)
        splits = splits[np.all(np.diff(splits, axis=1) > 0, axis=1)]
        busy, usable = self.busy(splits)
        if not usable.any():
            return tuple(int(x) for x in b)
        splits, busy = splits[usable], busy[usable]
        best = np.lexsort(((busy ** 2).sum(axis=1), busy.max(axis=1)))[0]  # the last key is the first compared
        return tuple(int(x) for x in splits[best])

    def busy(self, splits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each split's (rows) seconds per rank, and which splits are usable: no stage much slower than the
        split's slowest (the pipeline's flow stays), every stage fitting."""
        stages = splits.shape[1] - 1
        busy = np.zeros((len(splits), max(self.rank_of) + 1))
        held = np.zeros((len(splits), stages + 1))  # held[:, s]: what stages 0..s-1 hold up the ranks after them
        usable = np.ones(len(splits), dtype=bool)
        for st in range(stages):
            i, j = splits[:, st], splits[:, st + 1]
            seconds = np.asarray(self.time(st, i, j), dtype=np.float64)
            busy[:, self.rank_of[st]] += seconds * self.microbatches
            usable &= seconds <= self.slowest
            if self.fits is not None:
                usable &= np.asarray(self.fits(st, i, j), dtype=bool)
            held[:, st + 1] = held[:, st] + (0.0 if self.ahead is None else np.asarray(self.ahead(st, i, j)))
        first: dict[int, int] = {}
        for st, r in enumerate(self.rank_of):
            first.setdefault(r, st)
        for r, st in first.items():  # a rank holding no stage waits for nothing
            busy[:, r] += held[:, st]
        return busy, usable


def split_costs(costs: BlockCosts, num_stages: int, *, live: Sequence[int], budgets: Sequence[float],
                memory: MemoryModel, names: Sequence[str] = ()) -> Partition:
    """The fastest split whose stage s peaks under budgets[s] with live[s] microbatches in flight."""
    if num_stages > costs.num_blocks:
        raise SplitError(f"the model has {costs.num_blocks} blocks (cut points are between layers), fewer than "
                         f"{num_stages} stages; use at most {costs.num_blocks} stages")

    def fits(s: int, i: int, j: int) -> bool:
        return costs.stage_peak(i, j, live[s], memory) <= budgets[s]

    found = partition(costs.num_blocks, num_stages, lambda s, i, j: costs.stage_time(i, j), fits, grid=True)
    if found is None:
        raise SplitError(infeasible_message(costs, num_stages, live=live, budgets=budgets, memory=memory, names=names))
    return found


def infeasible_message(costs: BlockCosts, num_stages: int, *, live: Sequence[int], budgets: Sequence[float],
                       memory: MemoryModel, names: Sequence[str] = ()) -> str:
    """What the tightest split needs, which block is largest, and what would make it fit."""
    def peak(s: int, i: Any, j: Any) -> Any:  # one range, or grids of index arrays
        return costs.stage_peak(i, j, live[s], memory)

    # the split whose worst stage overshoots its budget least: what "needs at least" means
    over = partition(costs.num_blocks, num_stages, lambda s, i, j: peak(s, i, j) - budgets[s], grid=True)
    assert over is not None  # num_stages <= num_blocks was checked by the caller
    stage = max(range(num_stages), key=lambda s: peak(s, over.bounds[s], over.bounds[s + 1]) - budgets[s])
    need = peak(stage, over.bounds[stage], over.bounds[stage + 1])
    block = max(range(costs.num_blocks), key=lambda k: costs.stage_peak(k, k + 1, max(live), memory))
    label = f" ({names[block]})" if names else ""
    return (f"no split into {num_stages} stages fits: stage {stage} needs at least {nbytes(need)} with "
            f"{live[stage]} microbatch{'es' if live[stage] != 1 else ''} in flight, its limit is {nbytes(budgets[stage])}; the largest single "
            f"block{label} needs {nbytes(costs.stage_peak(block, block + 1, max(live), memory))} alone "
            f"({nbytes(costs.param_bytes[block] * memory.param_factor)} of weights, grads and optimizer "
            f"state, {nbytes(costs.saved[block])} of activations per microbatch); {FIX}")
