"""Making a candidate layout exact: stage autodiff for its stages, the blocks recalibrated, re-split until stable.

`search` ranks layouts on block estimates; the best of them comes here (`refine_auto`), or the user's own cuts
(`fixed_cuts`). A zero-bubble order is screened on the way (its hand-built orders timed) and searched once for
the split kept (`_searched`).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import attrs

import ir
import schedules

from ..errors import PlanError, SplitError
from ..units import nbytes
from . import replicas as replicas_mod
from .candidates import FROM_COSTS, Candidate, Candidates
from .layout import Layout
from .recompute import settle
from .stage_costs import StageCost, estimate, splits_bw

REFINE_ROUNDS = 4


def describe(layout: Layout) -> str:
    return (f"{layout.num_stages} stages on {layout.pipeline_depth} ranks{replicas_mod.describe(layout)} x dp "
            f"{layout.dp}, {layout.microbatches} microbatches")


def _calibrate(stages: Sequence[StageCost], guesses: Sequence[StageCost], bounds: Sequence[int],
               time_scale: list[float], saved_scale: list[float], split_bw: bool) -> None:
    """Scale each block's estimates by its stage's exact / estimated ratio (a recomputing stage's
    activations by its workspace: what it would keep is what it redoes)."""
    for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
        t = stages[k].time / guesses[k].time if guesses[k].time > 0 else 1.0
        if stages[k].recompute:
            held, guess = stages[k].workspace_bytes, guesses[k].workspace_bytes
        else:
            held, guess = stages[k].saved_bytes + (stages[k].b_to_w_bytes if split_bw else 0), guesses[k].saved_bytes
        m = held / guess if guess else 1.0
        for x in range(i, j):
            time_scale[x], saved_scale[x] = t, m


def _refine(planner: Candidates, first: Candidate) -> Candidate:
    """Make a candidate exact: stage autodiff for its stages, recalibrate the blocks, re-split until stable. A
    zero-bubble order is screened on the way (its hand-built orders timed) and searched for the split kept."""
    planner.screen = True
    try:
        best, blocks = _refine_split(planner, first)
        balanced = _balanced(planner, best, blocks)
    finally:
        planner.screen = False
    found = _searched(planner, best)
    for cand in balanced:  # judged by the order that will run, room and all, not by the screening
        if cand.step_time <= best.step_time * (1 + BALANCE_BAND):
            other = _searched(planner, cand)
            found = other if other.step_time < found.step_time else found
    return found


def _searched(planner: Candidates, screened: Candidate) -> Candidate:
    """`screened` with the zero-bubble order searched for its stages' costs (schedules.from_costs), unless the
    searched order is slower or overflows a rank: then the screened one stays (its options keep search=False,
    so the plan runs that order). A searched order is also given more room where that pays (`_roomier`)."""
    if planner.schedule not in FROM_COSTS:
        return screened
    table = planner.table(screened.layout)
    found = planner.evaluate(screened.layout, screened.stages, table, fine=screened.fine, bounds=screened.bounds)
    fits = max(found.rank_memory) <= planner.limit
    return _roomier(planner, found, table) if fits and found.step_time <= screened.step_time else screened


ROOMS = (2, 4, 8)  # stage-microbatches more per rank that a searched zero-bubble order may hold where memory allows
ROOM_GAIN = 0.01  # predicted faster by this much to spend the memory (the planner's tie band, auto.py's too)


def _roomier(planner: Candidates, searched: Candidate, table: Any) -> Candidate:
    """`searched`, or its order searched again holding more stage-microbatches per rank than its schedule's
    default (what the layout's fixed order holds, `table`) or the searched order, whichever is more: each of
    ROOMS more in turn, kept where every rank fits and it is predicted ROOM_GAIN faster than the best so far
    (more memory is spent only where it buys time). An order held to the default count (zbv: 2p) waits where
    one more microbatch's forward would fill a gap: on 4 x H100's GPT zbv costs (2026-11-26) 8 -> 10 cut the
    predicted step 1.3 %, 10 -> 12 another 2.1 %, 16 nothing more (the memory model counts the extra
    activations; a rank that would overflow keeps the smaller count). Not for replicated layouts (their orders
    are not built from costs) nor past from_costs' size for searching (only its seeds are timed there)."""
    layout = searched.layout
    if layout.replicated or layout.num_stages * layout.microbatches >= schedules.from_costs._HUGE:
        return searched
    held = schedules.simulate(planner.table(layout, searched.stages)).peak_live  # per rank (memory.peak_live: stage)
    default = schedules.simulate(table).peak_live
    best = searched
    for room in ROOMS:
        try:
            roomy = planner.evaluate(layout, searched.stages, table, fine=searched.fine, bounds=searched.bounds,
                                     live=[max(h, d) + room for h, d in zip(held, default)])
        except schedules.ScheduleError:  # no order within those counts: try a larger room
            continue
        if max(roomy.rank_memory) > planner.limit:
            break  # a larger room holds more still
        if roomy.step_time < best.step_time * (1 - ROOM_GAIN):
            best = roomy
    return best


@attrs.frozen
class _Blocks:
    """What the last split of `_refine_split` was made from: the blocks, their calibrated scales, the budgets."""

    blocks: Any
    time_scale: list[float]
    saved_scale: list[float]
    budgets: list[float]


def _refine_split(planner: Candidates, first: Candidate) -> tuple[Candidate, _Blocks]:
    layout = first.layout
    size = layout.microbatch_size(planner.batch_size)
    table, graph = planner.table(layout), planner.graph(size)
    split_bw = splits_bw(table)
    blocks = planner.blocks(size, first.fine, exact=True, split_bw=split_bw)
    time_scale, saved_scale = [1.0] * blocks.num_blocks, [1.0] * blocks.num_blocks
    budgets = [planner.limit / layout.stages_per_rank] * layout.num_stages
    part, flags = planner.split(layout, table, blocks)
    bounds, seen, best, last = part.bounds, set(), None, None
    for _ in range(REFINE_ROUNDS):
        last = settle(planner, layout, table, size, [blocks.bounds[b] for b in bounds[1:-1]], flags,
                      fine=first.fine, bounds=bounds)
        stages = last.stages
        if max(last.rank_memory) <= planner.limit and (best is None or last.step_time < best.step_time):
            best = last
        seen.add((bounds, flags))
        _calibrate(stages, estimate(graph, blocks, bounds, recompute=flags), bounds, time_scale, saved_scale,
                   split_bw)
        seen_peaks = planner.block_peaks(table, blocks, bounds, flags, time_scale, saved_scale, layout)
        for rank, peak in enumerate(last.rank_memory):
            for s in table.stages_of(rank) if peak > planner.limit else ():  # so that this split no longer fits
                budgets[s] = min(budgets[s], seen_peaks[s]) * planner.limit / peak
        try:
            part, flags = planner.split(layout, table, blocks, time_scale, saved_scale, budgets)
        except SplitError:
            if best is not None:
                break
            raise
        bounds = part.bounds
        if (bounds, flags) in seen and best is not None:
            break
    if best is None:
        raise SplitError(_exact_overflow(last, planner.limit, table, planner.recompute))
    return best, _Blocks(blocks, time_scale, saved_scale, budgets)


SLACKS = (0.0, 0.05, 0.1, 0.2)  # how much slower than the splitter's slowest stage a balanced split's may be
BALANCE_BAND = 0.02  # a balanced split screened this much slower than the splitter's is not searched (its cost)


def _balanced(planner: Candidates, best: Candidate, made: _Blocks) -> list[Candidate]:
    """The same layout as `best` with its cuts moved so that the busiest rank does less (`Candidates.balanced`:
    where a rank holds several stages, the splitter's slowest-stage objective leaves the ranks' sums apart): one
    balanced split for each of SLACKS, by work alone and with the forwards ahead of each rank (`ahead`), each new
    one made exact; those that fit (screened), fastest first. `_refine` keeps one only if it is faster once its
    order is searched too: the screening's hand-built orders do not rank them as the search does (GPT zbv at
    p = 4 on session 21's measured programs, replanned on CPU: screened, the split by work alone led; searched,
    the split with the forwards ahead simulated 0.5 % faster). Session 20's 4 x H100 costs, GPT zbv at p = 4
    (`benchmarks/plan_zbv.py --trace-on cpu`): the busiest rank 1.070 -> 1.018 x the mean, the step predicted
    100.5 -> 95.8 ms (96.5 balanced by work alone). Measured on 4 x H100 (session 21), the stage programs
    simulated 1.3-2.5 % faster than session 20's split's and the step was not faster (the programs ran 1.075-1.088
    x their start-up times in it, against 1.051).
    Not where a stage recomputes its whole forward (balancing keeps every stage within budget without)."""
    if best.layout.stages_per_rank == 1 or any(level is True for level in best.recompute):
        return []
    blocks, time_scale, saved_scale, budgets = made.blocks, made.time_scale, made.saved_scale, made.budgets
    layout, table = best.layout, planner.table(best.layout)
    size = layout.microbatch_size(planner.batch_size)
    tried, made_exact = {tuple(best.bounds)}, []
    for slack, ahead in itertools.product(SLACKS, (True, False)):
        bounds = planner.balanced(layout, table, blocks, best.bounds, time_scale, saved_scale, budgets, slack=slack,
                                  ahead=ahead)
        if bounds in tried:
            continue
        tried.add(bounds)
        cand = settle(planner, layout, table, size, [blocks.bounds[b] for b in bounds[1:-1]],
                      (False,) * len(best.stages), fine=best.fine, bounds=bounds)
        if max(cand.rank_memory) <= planner.limit:
            made_exact.append(cand)
    return sorted(made_exact, key=lambda c: c.step_time)


def refine_auto(planner: Candidates, first: Candidate) -> Candidate:
    """`_refine`; when "auto" made stages recompute, also the best split without any, and the faster of the two."""
    best = _refine(planner, first)
    if planner.recompute != "auto" or not any(best.recompute):
        return best
    planner.recompute = False
    try:
        plain = _refine(planner, planner.estimated(first.layout))
    except (SplitError, schedules.ScheduleError):
        return best
    finally:
        planner.recompute = "auto"
    return plain if plain.step_time <= best.step_time else best


def _exact_overflow(cand: Candidate, limit: float, table: schedules.Table, mode: bool | str = False) -> str:
    rank = max(range(len(cand.rank_memory)), key=lambda r: cand.rank_memory[r])
    mine = table.stages_of(rank)
    largest = max(cand.stages, key=lambda s: s.saved_bytes + s.b_to_w_bytes)
    redo = [k for k in mine if cand.stages[k].recompute]
    if mode is False:
        fix = ("make it fit with activation recomputation (recompute='auto'), more pipeline stages, or a smaller "
               "microbatch (more microbatches per step); or raise memory_limit")
    else:
        fix = ("make it fit with more pipeline stages or a smaller microbatch (more microbatches per step); or raise "
               "memory_limit")
    done = f", with activation recomputation on stages {redo}" if redo else ""
    return (f"{describe(cand.layout)}: rank {rank} (stages {list(mine)}) needs {nbytes(cand.rank_memory[rank])} by "
            f"stage autodiff{done}, the limit is {nbytes(limit)}; the largest stage keeps "
            f"{nbytes(largest.saved_bytes + largest.b_to_w_bytes)} of activations per microbatch; {fix}")


def fixed_cuts(planner: Candidates, candidates: Sequence[Layout], cuts: Sequence[int]) -> Candidate:
    """The user's cuts, costed exactly, under the fastest layout that fits."""
    best, reasons = None, []
    for layout in candidates:
        size = layout.microbatch_size(planner.batch_size)
        try:
            table = planner.table(layout)
            if _over_without_recompute(planner, layout, table, size, cuts):
                planner.shard_instead(layout)  # ZeRO-1 "auto" before recomputation: it costs no compute
            cand = _fixed_recompute(planner, layout, table, size, cuts)
        except (schedules.ScheduleError, ir.IRError) as err:
            raise PlanError(f"cuts {list(cuts)} with {describe(layout)}: {err}") from err
        if max(cand.rank_memory) > planner.limit:
            reasons.append(_exact_overflow(cand, planner.limit, table, planner.recompute))
        elif best is None or cand.step_time < best.step_time:
            best = cand
    if best is None:
        raise SplitError("; ".join(reasons))
    return best


def _over_without_recompute(planner: Candidates, layout: Layout, table: schedules.Table, size: int,
                            cuts: Sequence[int]) -> bool:
    """Whether the cuts overflow a rank with no more recomputation than asked (only probed where
    shard_optimizer="auto" could still shard this layout)."""
    recipe = planner.memory.recipe
    if recipe is None or recipe.shard_optimizer != "auto" or layout.dp == 1:
        return False
    levels: list[bool | str] = [planner.recompute is True] * layout.num_stages
    cand = planner.evaluate(layout, planner.exact(size, cuts, levels), table)
    return max(cand.rank_memory) > planner.limit


def _fixed_recompute(planner: Candidates, layout: Layout, table: schedules.Table, size: int,
                     cuts: Sequence[int]) -> Candidate:
    """Fixed cuts costed exactly; with recompute "auto", the stages of each rank over the limit
    recompute (until every rank fits or all its stages do), the cheap level first (`recompute.settle`)."""
    flags = [planner.recompute is True] * layout.num_stages
    while True:
        cand = settle(planner, layout, table, size, cuts, flags)
        over = [s for r, peak in enumerate(cand.rank_memory) if peak > planner.limit for s in table.stages_of(r)
                if not flags[s]]
        if planner.recompute != "auto" or not over:
            return cand
        for s in over:
            flags[s] = True
