"""Replicas per stage in planning: the user's counts checked, unequal layouts proposed, split and simulated.

RaNNC replicates each subgraph as often as its cost asks (its resnet152x8 plan: three subgraphs x 16, 8
and 8 on 32 ranks); fnpipe's layouts so far gave every pipeline position the same count (`world = p x dp`).
Here a layout may carry `replicas`, ranks per pipeline position inside one dp replica, so
`world = sum(replicas) x dp`; `(2, 1, 1) x dp 8` is RaNNC's plan.

Representation. A count per pipeline position, not per stage: the ranks of a position hold all its
stages (v of them under interleaved-1f1b and zbv), so a microbatch handed between two stages of one
position never leaves its rank, and every schedule keeps its table. The Plan stores `replicas` (all
ones: exactly the plans made before) and, when the planner chose unequal counts, `equal_step_time`,
the best prediction with equal ones, which `print(plan)` shows next to its own.

Routing (`schedules.Replicas`): the table is the schedule of the p positions over all `microbatches` of
a dp replica; replica k of position q runs microbatch i when `i % replicas[q] == k`. Round-robin is
deterministic, gives each replica the same share (the counts must divide the microbatch count), and
starts consecutive microbatches on different replicas at once. A replica orders its actions as its
position's row filtered ("split") or as the schedule of its own share ("own": a 1F1B replica then warms
up like a whole position); every layout is planned in both orders and the faster is kept
(`Plan.replica_order`). Schedule tables stay what they are; the routed rows and their transfers are a
layer over them (`schedules.replica_rows`, `schedules.lower_replicated`).

Splitting. A position with r replicas processes 1/r of the microbatches, so the splitter balances each
stage's time divided by its position's count (the same exact DP, `split.partition`), with each stage's
in-flight microbatches taken from the routed rows. The routed rows are simulated
(`schedules.simulate_replicated`); each position's grads are all-reduced over its own `r x dp` ranks.

When. `replicas=(2, 1)` asks for counts (checked here before any communication); `replicas="auto"` (and
the default whenever `stages` or `dp` is "auto") also plans unequal layouts: for each depth p below the
ranks of a dp replica, the ranks are apportioned to the positions by their stage times (each spare rank
goes to the position with the largest time per replica, the apportionment that minimises the slowest),
re-split and re-apportioned until stable. An unequal layout wins only when its exact prediction beats
the best equal one by REPLICA_GAIN: it needs more channels and a routing a user must read.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import attrs
import numpy as np

import schedules

from ..errors import PlanError, SplitError
from ..units import nbytes
from .layout import AUTO, Layout, divisors, microbatch_counts
from .split import Partition, partition
from .memory import MemoryModel
from .stage_costs import StageCost, schedule_costs, splits_bw

if TYPE_CHECKING:
    from .blocks import Blocks
    from .candidates import Candidate, Candidates

REPLICA_GAIN = 0.05   # an unequal layout must be predicted 5 % faster than the best equal one
MAX_DEPTH = 8         # unequal layouts are tried for pipeline depths 2..8 inside a dp replica
ROUNDS = 3            # split -> apportion rounds per depth


def requested(value: Any) -> tuple[int, ...] | str | None:
    """The user's `replicas`: None, "auto", or one count >= 1 per pipeline position; PlanError otherwise."""
    if value is None or (isinstance(value, str) and value.lower() == AUTO):
        return None if value is None else AUTO
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise PlanError(f"replicas must be None, 'auto' or one count per pipeline stage like (2, 1); got {value!r}")
    counts = tuple(value)
    if len(counts) < 1 or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise PlanError(f"replicas must be one int >= 1 per pipeline stage, like (2, 1) for stage 0 on 2 ranks and "
                        f"stage 1 on 1; got {value!r}")
    return counts


def explicit_layouts(counts: tuple[int, ...], world_size: int, batch_size: int, *, v: int, stages: Any, dp: Any,
                     microbatches: Any) -> list[Layout]:
    """The layouts of the user's counts: dp = world / sum(counts); microbatch counts every count divides."""
    n = sum(counts)
    if world_size % n:
        raise PlanError(f"replicas={counts} use {n} ranks per pipeline replica, which does not divide world_size="
                        f"{world_size}; give counts summing to a divisor of {world_size} ({divisors(world_size)})")
    if isinstance(dp, int) and not isinstance(dp, bool) and dp * n != world_size:
        raise PlanError(f"replicas={counts} x dp={dp} make {dp * n} ranks, the world has {world_size}; "
                        f"leave dp out (it is world_size / sum(replicas) = {world_size // n})")
    if isinstance(stages, int) and not isinstance(stages, bool) and stages != len(counts) * v:
        raise PlanError(f"stages={stages} but replicas={counts} name {len(counts)} pipeline stages "
                        f"({v} stage{'s' if v > 1 else ''} per rank make {len(counts) * v}); give one count per stage")
    group = world_size // n
    options = [m for m in microbatch_counts(batch_size, len(counts), group, microbatches) if m % _lcm(counts) == 0]
    if not options and not isinstance(microbatches, int):
        options = [m for m in divisors(batch_size // group) if m % _lcm(counts) == 0][:1] \
            if batch_size % group == 0 else []
    if not options:
        rows = batch_size // max(group, 1)
        raise PlanError(f"replicas={counts}: microbatches={microbatches!r} must be a multiple of {_lcm(counts)} (every "
                        f"replica of a stage runs the same share) that divides the {rows} rows of each of the "
                        f"dp={group} replicas; pick a batch size and microbatch count that fit")
    orders = schedules.ORDERS if any(c > 1 for c in counts) else ("split",)
    return [Layout(len(counts), v, group, m, counts, order) for m in options for order in orders]


def _lcm(counts: Sequence[int]) -> int:
    return math.lcm(*counts)


def apportion(times: Sequence[float], ranks: int) -> tuple[int, ...]:
    """Ranks per position, at least one each, minimising the largest time / count (each spare rank goes to
    the position that is slowest per replica; ties to the first)."""
    counts = [1] * len(times)
    for _ in range(ranks - len(times)):
        slowest = max(range(len(times)), key=lambda q: (times[q] / counts[q], -q))
        counts[slowest] += 1
    return tuple(counts)


def position_times(stages: Sequence[StageCost], table: schedules.Table) -> list[float]:
    return [sum(stages[s].time for s in table.stages_of(q)) for q in range(table.num_ranks)]


def split(planner: Candidates, layout: Layout, table: schedules.Table, blocks: Blocks,
          time_scale: Sequence[float] | None = None, saved_scale: Sequence[float] | None = None,
          budgets: Sequence[float] | None = None) -> tuple[Partition, tuple[bool, ...]]:
    """`Candidates.split` for a replicated layout: the slowest of time / replicas is minimised, each stage
    fits with the microbatches in flight on one of its replicas (the same recompute rule)."""
    rc, memory, mode = planner.recompute_costs(blocks, time_scale, saved_scale), _memory(planner, layout), \
        planner.recompute
    costs, n = rc.costs, layout.num_stages
    if n > costs.num_blocks:
        raise SplitError(f"the model has {costs.num_blocks} blocks (cut points are between layers), fewer than {n} "
                         f"stages; use at most {costs.num_blocks} stages")
    budgets = budgets or [planner.limit / layout.stages_per_rank] * n
    routed = schedules.simulate_replicated(table, schedules.Replicas(layout.counts), rows=rows(planner, layout))
    live = routed.stage_peak_live
    weight = [1.0 / layout.counts[table.rank_of(s)] for s in range(n)]

    def plain(s: int, i: Any, j: Any) -> Any:  # one range, or grids of index arrays (`partition(grid=True)`)
        if mode is True:
            return np.zeros(np.broadcast(i, j).shape, dtype=bool) if isinstance(i, np.ndarray) else False
        return costs.stage_peak(i, j, live[s], memory) <= budgets[s]

    def fits(s: int, i: Any, j: Any) -> Any:
        return plain(s, i, j) | (rc.peak(i, j, live[s], memory) <= budgets[s]) if mode is not False else plain(s, i, j)

    def time(s: int, i: Any, j: Any) -> Any:
        return np.where(plain(s, i, j), costs.stage_time(i, j), rc.time(i, j)) * weight[s]

    found = partition(costs.num_blocks, n, time, fits, grid=True)
    if found is None:
        raise SplitError(f"no split into {n} stages with replicas {layout.counts} fits the memory limit "
                         f"({nbytes(planner.limit)} per rank; each replica holds its whole stage); use more stages, "
                         "activation recomputation (recompute='auto'), or a smaller microbatch")
    b = found.bounds
    return found, tuple(not bool(plain(s, b[s], b[s + 1])) for s in range(n))


def evaluate(planner: Candidates, layout: Layout, stages: tuple[StageCost, ...], table: schedules.Table, *,
             fine: bool = False, bounds: tuple[int, ...] = ()) -> Candidate:
    """`Candidates.evaluate` for a replicated layout: the routed rows simulated; each position's grads
    all-reduced over its replicas in every dp replica (the slowest position's sum counts)."""
    from .candidates import Candidate

    counts, memory = layout.counts, _memory(planner, layout)
    run = schedules.simulate_replicated(table, schedules.Replicas(counts),
                                        schedule_costs(stages, table, planner.model, memory),
                                        rows=rows(planner, layout))
    sums = [planner.model.allreduce_time(sum(stages[s].param_bytes for s in table.stages_of(q)), counts[q] * layout.dp)
            for q in range(table.num_ranks)]
    allreduce = max(sums)
    margin = 1 + memory.margin
    ranks = schedules.Replicas(counts)
    rank_memory = tuple(max(run.peak_memory[r] for r in ranks.ranks(q)) * margin for q in range(table.num_ranks))
    mems = [s.memory(memory, split_bw=splits_bw(table)) for s in stages]
    stage_memory = tuple(memory.peak(m, run.stage_peak_live[k]) for k, m in enumerate(mems))
    return Candidate(layout, fine, bounds, stages, run.makespan + allreduce, run.makespan, run.bubble_fraction,
                     allreduce, rank_memory, tuple(s.recompute for s in stages), stage_memory,
                     tuple(s.remat for s in stages), False)


def _memory(planner: Candidates, layout: Layout) -> MemoryModel:
    """The layout's memory model without ZeRO-1: the sharded optimizer splits a stage's state over its dp group
    (engine/training/zero.py), which does not know replicas per stage yet; a recipe that insists on ZeRO-1
    makes every unequal layout infeasible."""
    recipe = planner.memory.recipe
    if recipe is not None and recipe.shard_optimizer is True:
        raise SplitError(f"replicas {layout.counts}: ZeRO-1 (shard_optimizer=True) with replicas per stage is not "
                         "supported yet; pass shard_optimizer=False or 'auto', or equal replicas")
    memory = planner.memory_for(layout)
    return attrs.evolve(memory, zero=False) if memory.zero else memory


def auto_layouts(planner: Candidates, world_size: int, *, v: int, stages: Any, dp: Any,
                 microbatches: Any) -> list[Layout]:
    """Unequal layouts worth planning: per dp and depth p below the ranks of a dp replica, the counts
    apportioned to the estimated stage times (re-split until they stop changing), at the smallest and
    the largest microbatch counts they divide among those of the equal layout on the same ranks (so no
    microbatch size is traced for them alone), in both replica orders."""
    out = []
    for group in divisors(world_size):
        n = world_size // group
        if isinstance(dp, int) and not isinstance(dp, bool) and group != dp:
            continue
        for p in range(2, min(n - 1, MAX_DEPTH) + 1):
            if isinstance(stages, int) and not isinstance(stages, bool) and stages != p * v:
                continue
            # the microbatch counts of the equal layout on the same ranks: sizes already traced and costed
            options = microbatch_counts(planner.batch_size, n, group, microbatches)
            if not options:
                continue
            counts = _settle(planner, p, v, group, options, n)
            if counts is None or len(set(counts)) == 1:
                continue
            fitting = [m for m in options if m % _lcm(counts) == 0]
            ends = sorted({fitting[0], fitting[-1]}) if fitting else []  # fewest bubbles, largest microbatches
            out += [Layout(p, v, group, m, counts, order) for m in ends for order in schedules.ORDERS]
    return out


def _settle(planner: Candidates, p: int, v: int, dp: int, options: Sequence[int], ranks: int) -> tuple[int, ...] | None:
    """Counts for `ranks` ranks over p positions, from the estimated split (at the most microbatches among
    `options` that the counts divide), re-split with them until they stop changing."""
    counts: tuple[int, ...] = ()
    for _ in range(ROUNDS):
        fitting = [m for m in options if m % _lcm(counts or (1,)) == 0]
        if not fitting:
            return None
        layout = Layout(p, v, dp, fitting[-1], counts)
        try:
            cand = planner.estimated(layout)
        except (SplitError, schedules.ScheduleError):
            return counts or None
        new = apportion(position_times(cand.stages, planner.table(layout)), ranks)
        if new == counts:
            break
        counts = new
    return counts


def considered(counts: tuple[int, ...] | str | None, stages: Any, dp: Any) -> bool:
    """Whether the search plans unequal layouts: `replicas="auto"`, or by default when stages or dp is "auto"."""
    return counts == AUTO or (counts is None and AUTO in (str(stages).lower(), str(dp).lower()))


def promising(unequal: Sequence[Candidate], equal: Sequence[Candidate], nothing_fits: bool) -> bool:
    """Whether the best unequal estimate beats the best equal one by REPLICA_GAIN (or no equal layout fits):
    only then is it made exact (stage autodiff of its stages is the expensive part of planning)."""
    if not unequal:
        return False
    return nothing_fits or not equal or unequal[0].step_time < (1 - REPLICA_GAIN) * equal[0].step_time


def choose(equal: Candidate | None, unequal: Candidate | None) -> tuple[Candidate, float] | None:
    """The unequal candidate with the equal one's step time when it is REPLICA_GAIN faster (or the only one
    that fits), else the equal one with 0; None when neither fits."""
    if unequal is None or (equal is not None and unequal.step_time >= (1 - REPLICA_GAIN) * equal.step_time):
        return None if equal is None else (equal, 0.0)
    return unequal, 0.0 if equal is None else equal.step_time


def rows(planner: Candidates, layout: Layout) -> tuple[tuple[schedules.Action, ...], ...]:
    """Each rank's compute actions in the layout's replica order (ScheduleError when that order cannot run)."""
    from .candidates import schedule_options

    options = schedule_options(planner.schedule, layout)
    return schedules.replica_rows(lambda m: planner.build(layout.num_stages, m, **options), layout.microbatches,
                                  schedules.Replicas(layout.counts), layout.replica_order)


def describe(layout: Layout) -> str:
    """` with replicas 2x1 (split order)` for a replicated layout, "" otherwise."""
    return f" with replicas {'x'.join(map(str, layout.counts))} ({layout.replica_order} order)" \
        if layout.replicated else ""
