"""Candidates: each layout split on its blocks and simulated with its schedule, costs kept per microbatch size.

`Candidates` holds what the search asks for again and again: the graph and blocks at each microbatch
size (from the `Workshop`, so each size is traced once and each stage differentiated once), exact stage
costs per equation range, and the schedule's builder (looked up once).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

import ir
import schedules

from ..errors import PlanError, SplitError
from ..names import abbreviate
from .artifacts import Workshop, build_table
from .blocks import Blocks, coarsen
from . import replicas
from .layout import Layout
from .dp_memory import with_allreduce
from .memory import MemoryModel, peak_live, rank_peaks, stage_peaks
from .op_costs import CostModel
from .split import BlockCosts, Partition, balance_ranks
from .stage_costs import (RecomputeCosts, StageCost, estimate, exact, exact_blocks, mostly_split, schedule_costs,
                          split_recompute, splits_bw)

MULTI_STAGE_SCHEDULES = {"interleaved-1f1b": "stages_per_rank", "looped-bfs": "stages_per_rank",
                         "interleaved-zb": "stages_per_rank", "zbv": None, "dualpipev": None}
V_SHAPED = ("zbv", "dualpipev")  # exactly two stages per rank
# the zero-bubble family builds its order from the stages' F, B, W and transfer times (schedules.from_costs)
FROM_COSTS = ("zb-h1", "zbv", "interleaved-zb", "dualpipev")
COST_DIGITS = 4  # significant digits of the times handed to the schedule: a readable, stable plan
INNER_CUT_GAIN = 0.05  # cut inside modules only when that makes the slowest stage 5 % faster


@attrs.frozen
class Candidate:
    """A layout with its split (block bounds), stage costs and simulated step."""

    layout: Layout
    fine: bool                  # bounds index the blocks with cuts inside modules too
    bounds: tuple[int, ...]
    stages: tuple[StageCost, ...]
    step_time: float
    makespan: float
    bubble: float
    allreduce: float
    rank_memory: tuple[float, ...]
    recompute: tuple[bool, ...] = ()
    stage_memory: tuple[float, ...] = ()  # each stage's own peak (what the plan table shows)
    remat: tuple[bool, ...] = ()          # per stage: cheap recomputation (norms, pointwise chains)
    zero: bool = False  # ZeRO-1: optimizer state (and master weights) split over the dp replicas
    options: tuple[tuple[str, Any], ...] = ()  # the schedule's options (its costs, for the zero-bubble family)


class Candidates:
    """Splits and simulates layouts of one model; caches per microbatch size (blocks, exact stage costs)."""

    def __init__(self, workshop: Workshop, *, schedule: str, build: Callable[..., schedules.Table],
                 model: CostModel, memory: MemoryModel, limit: float, min_blocks: int,
                 recompute: bool | str = False, fused_recompute: bool = False,
                 blocks: dict[tuple[Any, ...], Blocks] | None = None) -> None:
        self.workshop, self.batch = workshop, workshop.batch
        self.recompute = recompute
        self.fused_recompute = fused_recompute  # the compiler fuses cheap recomputation: see recompute.settle
        self.schedule, self.build, self.model, self.memory, self.limit = schedule, build, model, memory, limit
        self.min_blocks = min_blocks
        self._tables: dict[Layout, schedules.Table] = {}
        self._live: dict[int, tuple[schedules.Table, tuple[int, ...]]] = {}  # id(table) -> (table, its peak_live)
        self.screen = False  # evaluate zero-bubble orders by their hand-built seeds only (see `evaluate`)
        self._zero: dict[Layout, bool] = {}  # "auto": the layouts that fit only with ZeRO-1
        # shared by the planners of one search (schedule="auto": one per candidate schedule, one model and workshop)
        self._blocks: dict[tuple[Any, ...], Blocks] = {} if blocks is None else blocks
        self._exact: dict[int, dict[tuple[int, int, bool], StageCost]] = {}

    def _costs_for(self, table: schedules.Table) -> None:
        """Cost stages as `table`'s schedule runs most of their backwards (`mostly_split`): B and W apart at
        their own measured ratios, or fused at the whole backward's (`CostModel.split_backward`). One schedule's
        tables agree, so this changes the model at most once, at the first table, before any exact stage is
        costed."""
        split = mostly_split(table)
        if self.model.split_backward != split:
            self.model = attrs.evolve(self.model, split_backward=split)
            self._exact = {}

    def memory_for(self, layout: Layout) -> MemoryModel:
        """The memory model of this layout: its dp, and ZeRO-1 where the recipe asks (or "auto" chose it)."""
        recipe = self.memory.recipe
        zero = recipe is not None and (recipe.shard_optimizer is True or self._zero.get(layout, False))
        if self.memory.dp == layout.dp and self.memory.zero == zero:
            return self.memory
        return attrs.evolve(self.memory, dp=layout.dp, zero=zero)

    def graph(self, size: int) -> ir.Graph:
        return self.workshop.graph(size)

    def differentiate(self, size: int) -> Callable[[ir.Stage, bool | str], ir.StageAD]:
        """Stage autodiff for costing at this microbatch size: joints stitched from the blocks' (fine and coarse
        bounds both, see `Workshop.costing`), so each distinct block is traced once whatever stages the search
        tries."""
        pieces = self.pieces(size)
        return lambda stage, recompute: self.workshop.costing(size, stage, recompute, pieces)

    def pieces(self, size: int) -> tuple[int, ...]:
        """The block bounds (fine and coarse) whose pieces' joints stitch a stage's (`Workshop.costing`: a stage
        with a cut elsewhere, e.g. the user's inside a block, is traced)."""
        return tuple(sorted(set(self.blocks(size, True).bounds) | set(self.blocks(size, False).bounds)))

    def blocks(self, size: int, fine: bool, *, exact: bool = False, split_bw: bool = False) -> Blocks:
        """Blocks at this microbatch size, with estimated costs or (`exact`) costs from stage autodiff
        (`split_bw`: the schedule runs B and W apart)."""
        key = (size, fine, exact, split_bw and exact, self.min_blocks, self.model.split_backward)
        if key not in self._blocks:
            if exact:
                self._blocks[key] = exact_blocks(self.graph(size), self.blocks(size, fine), self.model,
                                                 split_bw=split_bw, differentiate=self.differentiate(size))
            else:
                self._blocks[key] = coarsen(self.graph(size), self.model, fine=fine, min_blocks=self.min_blocks)
        return self._blocks[key]

    def exact(self, size: int, cuts: Sequence[int], recompute: Sequence[bool | str] = ()) -> tuple[StageCost, ...]:
        cache = self._exact.setdefault(size, {})
        return exact(self.graph(size), cuts, self.model, cache=cache, recompute=recompute,
                     differentiate=self.differentiate(size))

    def table(self, layout: Layout, stages: Sequence[StageCost] | None = None, *, screen: bool = False,
              live: Sequence[int] | None = None) -> schedules.Table:
        """The layout's table (built once per layout); with `stages`, the zero-bubble family's order built for
        their costs (`screen`: the hand-built orders timed under them, no search: see `estimated`; `live`: at
        most that many stage-microbatches held per rank, the order's `max_live`, instead of its default)."""
        if stages is not None:
            options = dict(self.options(layout, stages, live))
            if screen and self.schedule in FROM_COSTS:
                options["search"] = False
            built = build_table(self.build, self.schedule, layout.num_stages, layout.microbatches, options)
            self._costs_for(built)
            return built
        if layout not in self._tables:
            options = dict(self.options(layout))
            if self.schedule in FROM_COSTS:  # the splitter reads only its live counts; what runs is built for costs
                options["search"] = False
            self._tables[layout] = build_table(self.build, self.schedule, layout.num_stages, layout.microbatches,
                                               options)
            self._costs_for(self._tables[layout])
        return self._tables[layout]

    def live(self, table: schedules.Table) -> tuple[int, ...]:
        """`memory.peak_live(table)`, simulated once per table (the splitter asks for every split it tries;
        at p = 128 one simulation takes seconds)."""
        key = id(table)
        if key not in self._live or self._live[key][0] is not table:
            self._live[key] = (table, peak_live(table))
        return self._live[key][1]

    def options(self, layout: Layout, stages: Sequence[StageCost] | None = None, live: Sequence[int] | None = None
                ) -> tuple[tuple[str, Any], ...]:
        chosen = schedule_options(self.schedule, layout)
        if stages is not None and self.schedule in FROM_COSTS:
            chosen["costs"] = order_costs(stages, self.model)
            if live is not None:
                chosen["max_live"] = tuple(int(x) for x in live)
        return tuple(sorted(chosen.items()))

    def block_costs(self, blocks: Blocks, time_scale: Sequence[float], saved_scale: Sequence[float]) -> BlockCosts:
        return BlockCosts(
            time=tuple(blocks.time(k) * time_scale[k] for k in range(blocks.num_blocks)),
            param_bytes=tuple(float(sum(blocks.param_bytes[p] for p in ps)) for ps in blocks.params),
            saved=tuple(blocks.saved[k] * saved_scale[k] for k in range(blocks.num_blocks)),
            cut_bytes=tuple(float(b) for b in blocks.cut_bytes),
            cut_time=tuple(self.model.comm_time(b) for b in blocks.cut_bytes),
            forward=tuple(blocks.forward[k] * time_scale[k] for k in range(blocks.num_blocks)))

    def evaluate(self, layout: Layout, stages: tuple[StageCost, ...], table: schedules.Table, *,
                 fine: bool = False, bounds: tuple[int, ...] = (), screen: bool | None = None,
                 live: Sequence[int] | None = None) -> Candidate:
        """Simulate `stages` under the layout's schedule (the zero-bubble family's order rebuilt for their
        costs; `screen` (default `self.screen`): only its hand-built orders timed, an upper bound, and the
        candidate's options say so; `live`: the order built to hold at most that many stage-microbatches per
        rank); add the dp gradient all-reduce."""
        if layout.replicated:
            return replicas.evaluate(self, layout, stages, table, fine=fine, bounds=bounds)
        memory = self.memory_for(layout)
        options = self.options(layout, stages, live)
        if self.schedule in FROM_COSTS:
            screen = self.screen if screen is None else screen
            table = self.table(layout, stages, screen=screen, live=live)
            options = tuple(sorted({**dict(options), "search": False}.items())) if screen else options
        sim = schedules.simulate(table, schedule_costs(stages, table, self.model, memory))
        grads = [sum(stages[s].param_bytes for s in table.stages_of(r)) for r in range(table.num_ranks)]
        allreduce = self.model.allreduce_time(max(grads), layout.dp)
        mems = [s.memory(memory, split_bw=splits_bw(table)) for s in stages]
        # dp: the flat grad all-reduce's copy; with ZeRO-1 the program holds none (the optimizer reduce-scatters)
        summed = 1 if memory.zero else layout.dp
        peaks = with_allreduce(rank_peaks(table, mems, memory, sim), table, mems,
                               [s.param_bytes for s in stages], memory, summed)
        return Candidate(layout, fine, bounds, stages, sim.makespan + allreduce, sim.makespan, sim.bubble_fraction,
                         allreduce, peaks, tuple(s.recompute for s in stages),
                         stage_peaks(table, mems, memory, sim), tuple(s.remat for s in stages),
                         memory.zero and layout.dp > 1, options)

    def split(self, layout: Layout, table: schedules.Table, blocks: Blocks, time_scale: Sequence[float] | None = None,
              saved_scale: Sequence[float] | None = None, budgets: Sequence[float] | None = None
              ) -> tuple[Partition, tuple[bool, ...]]:
        """The fastest split of this layout's `blocks` whose stages fit their budgets, and which of its
        stages recompute their activations (see `stagecost.split_recompute`)."""
        if layout.replicated:
            return replicas.split(self, layout, table, blocks, time_scale, saved_scale, budgets)
        rc = self.recompute_costs(blocks, time_scale, saved_scale)
        budgets = budgets or [self.limit / layout.stages_per_rank] * layout.num_stages
        labels = [_block_label(blocks, k) for k in range(blocks.num_blocks)]
        return split_recompute(rc, layout.num_stages, mode=self.recompute, live=self.live(table), budgets=budgets,
                               memory=self.memory_for(layout), names=labels)

    def balanced(self, layout: Layout, table: schedules.Table, blocks: Blocks, bounds: Sequence[int],
                 time_scale: Sequence[float] | None = None, saved_scale: Sequence[float] | None = None,
                 budgets: Sequence[float] | None = None, *, slack: float = 0.0, ahead: bool = True
                 ) -> tuple[int, ...]:
        """`bounds` with its cuts moved so that no rank is busier than it must be (`split.balance_ranks`, no stage
        more than `slack` slower than its slowest), where a rank holds more than one stage. No stage may grow
        past its budget without recomputation, or past its own peak in `bounds` where that is over the budget
        already (a split made exact can keep a stage over its share while its rank fits: the caller checks the
        exact ranks)."""
        if layout.stages_per_rank == 1 or layout.replicated:
            return tuple(bounds)
        costs = self.block_costs(blocks, time_scale or [1.0] * blocks.num_blocks,
                                 saved_scale or [1.0] * blocks.num_blocks)
        live, memory = self.live(table), self.memory_for(layout)
        budgets = budgets or [self.limit / layout.stages_per_rank] * layout.num_stages
        room = [max(budgets[s], costs.stage_peak(i, j, live[s], memory))
                for s, (i, j) in enumerate(zip(bounds, bounds[1:]))]
        filled = splits_bw(table)  # the weight passes fill the end: only the first forward holds a rank up
        return balance_ranks(bounds, [table.rank_of(s) for s in range(layout.num_stages)],
                             lambda s, i, j: costs.stage_time(i, j),
                             lambda s, i, j: costs.stage_peak(i, j, live[s], memory) <= room[s], slack=slack,
                             ahead=(lambda s, i, j: costs.stage_ahead(i, j, backward=not filled)) if ahead else None,
                             microbatches=layout.microbatches)

    def recompute_costs(self, blocks: Blocks, time_scale: Sequence[float] | None = None,
                        saved_scale: Sequence[float] | None = None) -> RecomputeCosts:
        ones = [1.0] * blocks.num_blocks
        time_scale = time_scale or ones
        costs = self.block_costs(blocks, time_scale, saved_scale or ones)
        return RecomputeCosts(costs, tuple(blocks.forward[k] * time_scale[k] for k in range(blocks.num_blocks)))

    def block_peaks(self, table: schedules.Table, blocks: Blocks, bounds: Sequence[int], recompute: Sequence[bool],
                    time_scale: Sequence[float], saved_scale: Sequence[float], layout: Layout | None = None) -> list[float]:
        """Each stage's peak as the splitter sees it (block sums), to compare with the exact one."""
        rc, live = self.recompute_costs(blocks, time_scale, saved_scale), self.live(table)
        mem = self.memory if layout is None else self.memory_for(layout)
        return [rc.peak(i, j, live[k], mem) if recompute[k] else rc.costs.stage_peak(i, j, live[k], mem)
                for k, (i, j) in enumerate(zip(bounds, bounds[1:]))]

    @property
    def batch_size(self) -> int:
        return batch_size_of(self.batch)

    def estimated(self, layout: Layout) -> Candidate:
        """The layout split and simulated on block estimates (SplitError when nothing fits). Cuts stay
        between modules unless cutting inside them makes the slowest stage INNER_CUT_GAIN faster. With the
        recipe's shard_optimizer="auto", a layout that does not fit is tried again with ZeRO-1. A zero-bubble
        schedule is timed with its hand-built orders under the estimated costs (`screen`), not searched: a
        search per layout was 85 % of a plan's time (engine/planning/auto.py); the layouts made exact get it."""
        try:
            return self._estimated(layout)
        except SplitError:
            if not self.shard_instead(layout):
                raise
            return self._estimated(layout)

    def shard_instead(self, layout: Layout) -> bool:
        """With shard_optimizer="auto": plan `layout` with ZeRO-1 from now on, if it was not already and it
        has replicas to shard over. True when that changed something (the caller tries again)."""
        recipe = self.memory.recipe
        if recipe is None or recipe.shard_optimizer != "auto" or layout.dp == 1 or self._zero.get(layout):
            return False
        self._zero[layout] = True
        return True

    def _estimated(self, layout: Layout) -> Candidate:
        table = self.table(layout)
        size = layout.microbatch_size(self.batch_size)
        try:
            coarse: tuple[Partition, tuple[bool, ...]] | None = self.split(layout, table, self.blocks(size, False))
        except SplitError:
            coarse = None
        fine = self.split(layout, table, self.blocks(size, True))
        use_fine = coarse is None or fine[0].bottleneck < (1 - INNER_CUT_GAIN) * coarse[0].bottleneck
        chosen, flags = fine if use_fine or coarse is None else coarse
        stages = estimate(self.graph(size), self.blocks(size, use_fine), chosen.bounds, recompute=flags)
        return self.evaluate(layout, stages, table, fine=use_fine, bounds=chosen.bounds, screen=True)


def _block_label(blocks: Blocks, k: int) -> str:
    names = [blocks.names[p] for p in sorted(blocks.params[k])]
    return f"block {k}, equations {blocks.bounds[k]}-{blocks.bounds[k + 1] - 1}" + (f", {abbreviate(names)}" if names else "")


def schedule_options(schedule: str, layout: Layout) -> dict[str, Any]:
    key = MULTI_STAGE_SCHEDULES.get(schedule)
    return {key: layout.stages_per_rank} if key else {}


def order_costs(stages: Sequence[StageCost], model: CostModel) -> tuple[tuple[float, ...], ...]:
    """(forward, backward_input, backward_weight, transfer) per stage, in units of the slowest forward, to
    COST_DIGITS significant digits: plain numbers that JSON keeps exactly, so every rank builds one order."""
    unit = max(max(s.forward for s in stages), 1e-30)

    def cut(t: float) -> float:
        return float(f"{t / unit:.{COST_DIGITS}g}")

    return (tuple(cut(s.forward) for s in stages), tuple(cut(s.backward_input) for s in stages),
            tuple(cut(s.backward_weight) for s in stages),
            tuple(cut(model.comm_time(s.send_bytes)) for s in stages))


def batch_size_of(batch: Sequence[Any]) -> int:
    sizes = set()
    for i, x in enumerate(pytree.tree_leaves(tuple(batch))):
        if not isinstance(x, (torch.Tensor, ir.TensorSpec)) or len(x.shape) == 0:
            raise PlanError(f"batch leaf {i} is {type(x).__name__} {getattr(x, 'shape', '')}: every batch leaf must be "
                            "a tensor (or ir.TensorSpec) with the batch along dim 0")
        sizes.add(int(x.shape[0]))
    if len(sizes) != 1:
        raise PlanError(f"batch leaves have different sizes along dim 0: {sorted(sizes)}; the example batch must "
                        "be the full batch, every leaf cut along dim 0 into the same number of rows")
    return sizes.pop()
