"""The splitter: an exact dynamic programme over blocks that minimises the slowest stage within memory.

Stage k takes blocks [b_k, b_{k+1}); its time is its blocks' F+B+W plus sending across both its cuts;
its peak is its static bytes plus its microbatches in flight (from the schedule) times the activations
each keeps. `partition` finds the contiguous split whose slowest stage is fastest among those where every
stage fits its budget, in O(S K^2) for K blocks and S stages, on plain lists: no tracing here.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import attrs

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


def partition(num_blocks: int, num_stages: int, cost: Callable[[int, int, int], float],
              fits: Callable[[int, int, int], bool] | None = None) -> Partition | None:
    """The split of blocks 0..K-1 into `num_stages` non-empty ranges minimising the largest
    cost(stage, i, j) of its stages, with fits(stage, i, j) true for every stage; None when none fits."""
    k_max, s_max = num_blocks, num_stages
    if s_max < 1 or s_max > k_max:
        return None
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
    if best[s_max][k_max] == inf:
        return None
    bounds = [k_max]
    for s in range(s_max, 0, -1):
        bounds.append(arg[s][bounds[-1]])
    return Partition(tuple(reversed(bounds)), best[s_max][k_max])


@attrs.frozen
class BlockCosts:
    """What the splitter needs of each block and each bound, as plain numbers (seconds and bytes)."""

    time: tuple[float, ...]          # F+B+W per microbatch
    param_bytes: tuple[float, ...]   # bytes of the params it reads
    saved: tuple[float, ...]         # activation bytes kept per microbatch in flight
    cut_bytes: tuple[float, ...]     # K+1: bytes crossing each bound, 0 at both ends
    cut_time: tuple[float, ...]      # K+1: seconds to send them
    _time_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _param_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _saved_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name, values in (("_time_sum", self.time), ("_param_sum", self.param_bytes), ("_saved_sum", self.saved)):
            object.__setattr__(self, name, tuple(itertools.accumulate(values, initial=0.0)))

    @property
    def num_blocks(self) -> int:
        return len(self.time)

    def stage_time(self, i: int, j: int) -> float:
        """Seconds per microbatch of a stage of blocks [i, j): compute plus sends over its two cuts."""
        return self._time_sum[j] - self._time_sum[i] + self.cut_time[i] + self.cut_time[j]

    def stage_peak(self, i: int, j: int, live: int, memory: MemoryModel) -> float:
        """Peak bytes of a stage of blocks [i, j) with `live` microbatches in flight."""
        m = memory.stage(param_bytes=self._param_sum[j] - self._param_sum[i],
                         saved_bytes=self._saved_sum[j] - self._saved_sum[i],
                         recv_bytes=self.cut_bytes[i], send_bytes=self.cut_bytes[j])
        return memory.peak(m, live)


def split_costs(costs: BlockCosts, num_stages: int, *, live: Sequence[int], budgets: Sequence[float],
                memory: MemoryModel, names: Sequence[str] = ()) -> Partition:
    """The fastest split whose stage s peaks under budgets[s] with live[s] microbatches in flight."""
    if num_stages > costs.num_blocks:
        raise SplitError(f"the model has {costs.num_blocks} blocks (cut points are between layers), fewer than "
                         f"{num_stages} stages; use at most {costs.num_blocks} stages")

    def fits(s: int, i: int, j: int) -> bool:
        return costs.stage_peak(i, j, live[s], memory) <= budgets[s]

    found = partition(costs.num_blocks, num_stages, lambda s, i, j: costs.stage_time(i, j), fits)
    if found is None:
        raise SplitError(infeasible_message(costs, num_stages, live=live, budgets=budgets, memory=memory, names=names))
    return found


def infeasible_message(costs: BlockCosts, num_stages: int, *, live: Sequence[int], budgets: Sequence[float],
                       memory: MemoryModel, names: Sequence[str] = ()) -> str:
    """What the tightest split needs, which block is largest, and what would make it fit."""
    def peak(s: int, i: int, j: int) -> float:
        return costs.stage_peak(i, j, live[s], memory)

    # the split whose worst stage overshoots its budget least: what "needs at least" means
    over = partition(costs.num_blocks, num_stages, lambda s, i, j: peak(s, i, j) - budgets[s])
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
