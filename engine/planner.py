"""`engine.plan`: trace once per microbatch size, split with the DP, pick the fastest layout, verify it.

One process, no launch: a laptop plans for a cluster. Every candidate layout (pipeline depth, dp,
microbatches) is split on estimated block costs and simulated with its schedule; the fastest that fits in
memory is then made exact: its stages go through stage autodiff, the block estimates are corrected by
what autodiff reports, and the split is redone until it is stable and every rank fits.
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

import ir
import schedules

from .blocks import Blocks, coarsen
from .calibrate import Calibration
from .costmodel import CostModel, graph_hash
from .devices import DeviceProfile, LinkProfile, get_device, get_link
from .errors import PlanError, SplitError
from .layout import Layout, layouts
from .memory import MemoryModel, gib, peak_live, rank_peaks, stage_peaks
from .names import abbreviate
from .plan import Plan, StagePlan
from .split import BlockCosts, Partition, split_costs
from .stagecost import StageCost, estimate, exact, exact_blocks, schedule_costs

MULTI_STAGE_SCHEDULES = {"interleaved-1f1b": "stages_per_rank", "zbv": None}
REFINE_ROUNDS = 4
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


class Planner:
    """Caches per microbatch size (graph, blocks, exact stage costs) while layouts are tried."""

    def __init__(self, fn: Any, params: Any, batch: Sequence[Any], *, schedule: str, model: CostModel,
                 memory: MemoryModel, limit: float, min_blocks: int) -> None:
        self.fn, self.params, self.batch = fn, params, tuple(batch)
        self.schedule, self.model, self.memory, self.limit = schedule, model, memory, limit
        self.min_blocks = min_blocks
        self.trace_device = "cuda" if model.device.kind == "cuda" and torch.cuda.is_available() else "cpu"
        self._graphs: dict[int, ir.Graph] = {}
        self._blocks: dict[tuple[int, bool, bool, bool], Blocks] = {}
        self._exact: dict[int, dict[tuple[int, int], StageCost]] = {}

    def graph(self, size: int) -> ir.Graph:
        if size not in self._graphs:
            specs = pytree.tree_map(lambda x: _microbatch_spec(x, size), self.batch)
            self._graphs[size] = ir.trace(self.fn, self.params, *specs, device=self.trace_device)
        return self._graphs[size]

    def blocks(self, size: int, fine: bool, *, exact: bool = False, split_bw: bool = False) -> Blocks:
        """Blocks at this microbatch size, with estimated costs or (`exact`) costs from stage autodiff
        (`split_bw`: the schedule runs B and W apart)."""
        key = (size, fine, exact, split_bw and exact)
        if key not in self._blocks:
            if exact:
                self._blocks[key] = exact_blocks(self.graph(size), self.blocks(size, fine), self.model,
                                                 device=self.trace_device, split_bw=split_bw)
            else:
                self._blocks[key] = coarsen(self.graph(size), self.model, fine=fine, min_blocks=self.min_blocks)
        return self._blocks[key]

    def exact(self, size: int, cuts: Sequence[int]) -> tuple[StageCost, ...]:
        cache = self._exact.setdefault(size, {})
        return exact(self.graph(size), cuts, self.model, device=self.trace_device, cache=cache)

    def table(self, layout: Layout) -> schedules.Table:
        return schedules.get(self.schedule)(layout.num_stages, layout.microbatches, **schedule_options(self.schedule, layout))

    def block_costs(self, blocks: Blocks, time_scale: Sequence[float], saved_scale: Sequence[float]) -> BlockCosts:
        return BlockCosts(
            time=tuple(blocks.time(k) * time_scale[k] for k in range(blocks.num_blocks)),
            param_bytes=tuple(float(sum(blocks.param_bytes[p] for p in ps)) for ps in blocks.params),
            saved=tuple(blocks.saved[k] * saved_scale[k] for k in range(blocks.num_blocks)),
            cut_bytes=tuple(float(b) for b in blocks.cut_bytes),
            cut_time=tuple(self.model.comm_time(b) for b in blocks.cut_bytes))

    def evaluate(self, layout: Layout, stages: tuple[StageCost, ...], table: schedules.Table, *,
                 fine: bool = False, bounds: tuple[int, ...] = ()) -> Candidate:
        """Simulate `stages` under the layout's schedule; add the dp gradient all-reduce."""
        sim = schedules.simulate(table, schedule_costs(stages, table, self.model, self.memory))
        grads = [sum(stages[s].param_bytes for s in table.stages_of(r)) for r in range(table.num_ranks)]
        allreduce = self.model.allreduce_time(max(grads), layout.dp)
        peaks = rank_peaks(table, [s.memory(self.memory) for s in stages], self.memory)
        return Candidate(layout, fine, bounds, stages, sim.makespan + allreduce, sim.makespan, sim.bubble_fraction,
                         allreduce, peaks)

    def split(self, layout: Layout, table: schedules.Table, blocks: Blocks, time_scale: Sequence[float] | None = None,
              saved_scale: Sequence[float] | None = None, budgets: Sequence[float] | None = None) -> Partition:
        """The fastest split of this layout's `blocks` whose stages fit their budgets."""
        ones = [1.0] * blocks.num_blocks
        costs = self.block_costs(blocks, time_scale or ones, saved_scale or ones)
        budgets = budgets or [self.limit / layout.stages_per_rank] * layout.num_stages
        labels = [_block_label(blocks, k) for k in range(blocks.num_blocks)]
        return split_costs(costs, layout.num_stages, live=peak_live(table), budgets=budgets, memory=self.memory,
                           names=labels)

    @property
    def batch_size(self) -> int:
        return _batch_size(self.batch)

    def estimated(self, layout: Layout) -> Candidate:
        """The layout split and simulated on block estimates (SplitError when nothing fits). Cuts stay
        between modules unless cutting inside them makes the slowest stage INNER_CUT_GAIN faster."""
        table = self.table(layout)
        size = layout.microbatch_size(self.batch_size)
        try:
            coarse: Partition | None = self.split(layout, table, self.blocks(size, False))
        except SplitError:
            coarse = None
        fine = self.split(layout, table, self.blocks(size, True))
        use_fine = coarse is None or fine.bottleneck < (1 - INNER_CUT_GAIN) * coarse.bottleneck
        chosen = fine if use_fine or coarse is None else coarse
        stages = estimate(self.graph(size), self.blocks(size, use_fine), chosen.bounds)
        return self.evaluate(layout, stages, table, fine=use_fine, bounds=chosen.bounds)


def _block_label(blocks: Blocks, k: int) -> str:
    names = [blocks.names[p] for p in sorted(blocks.params[k])]
    return f"block {k}, equations {blocks.bounds[k]}-{blocks.bounds[k + 1] - 1}" + (f", {abbreviate(names)}" if names else "")


def schedule_options(schedule: str, layout: Layout) -> dict[str, Any]:
    key = MULTI_STAGE_SCHEDULES.get(schedule)
    return {key: layout.stages_per_rank} if key else {}


def _microbatch_spec(x: Any, size: int) -> ir.TensorSpec:
    if isinstance(x, ir.TensorSpec):
        return ir.TensorSpec((size, *x.shape[1:]), x.dtype, x.device)
    device = None if x.device.type == "meta" else str(x.device)
    return ir.TensorSpec((size, *x.shape[1:]), x.dtype, device)


def _batch_size(batch: Sequence[Any]) -> int:
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


def _stages_per_rank(schedule: str, stages_per_rank: int | None, stages: Any, dp: Any, world_size: int) -> int:
    if schedule == "zbv":
        if stages_per_rank not in (None, 2):
            raise PlanError(f"zbv places exactly 2 stages per rank (a V); got stages_per_rank={stages_per_rank}")
        return 2
    if stages_per_rank is not None:
        if stages_per_rank > 1 and schedule not in MULTI_STAGE_SCHEDULES:
            raise PlanError(f"schedule '{schedule}' runs one stage per rank; stages_per_rank={stages_per_rank} "
                            f"needs one of {sorted(MULTI_STAGE_SCHEDULES)}")
        return stages_per_rank
    if schedule in MULTI_STAGE_SCHEDULES and isinstance(stages, int) and not isinstance(dp, str):
        depth = world_size // (dp or 1)
        return max(1, stages // depth) if depth else 1
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


def _check_schedule(schedule: str) -> None:
    try:
        schedules.get(schedule)
    except (KeyError, ValueError) as err:
        raise PlanError(f"unknown schedule '{schedule}'; use one of {sorted(schedules.names())}") from err


def _rank_layouts(planner: Planner, candidates: Sequence[Layout]) -> tuple[list[Candidate], list[str]]:
    """Every layout split and simulated on estimates, fastest first; the reasons the others failed."""
    found, reasons = [], []
    for layout in candidates:
        try:
            found.append(planner.estimated(layout))
        except (SplitError, schedules.ScheduleError) as err:
            reasons.append(f"{_describe(layout)}: {err}")
    found.sort(key=lambda c: (c.step_time, c.layout.num_stages, c.layout.microbatches))
    return found, reasons


def _describe(layout: Layout) -> str:
    return (f"{layout.num_stages} stages on {layout.pipeline_depth} ranks x dp {layout.dp}, "
            f"{layout.microbatches} microbatches")


def _splits_bw(table: schedules.Table) -> bool:
    """Whether the schedule runs B and W as separate actions (so W's inputs wait in memory)."""
    return any(a.kind == "W" for row in table.rows for a in row)


def _calibrate(stages: Sequence[StageCost], guesses: Sequence[StageCost], bounds: Sequence[int],
               time_scale: list[float], saved_scale: list[float], split_bw: bool) -> None:
    """Scale each block's estimates by its stage's exact / estimated ratio."""
    for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
        t = stages[k].time / guesses[k].time if guesses[k].time > 0 else 1.0
        held = stages[k].saved_bytes + (stages[k].b_to_w_bytes if split_bw else 0)
        m = held / guesses[k].saved_bytes if guesses[k].saved_bytes else 1.0
        for x in range(i, j):
            time_scale[x], saved_scale[x] = t, m


def _refine(planner: Planner, first: Candidate) -> Candidate:
    """Make a candidate exact: stage autodiff for its stages, recalibrate the blocks, re-split until stable."""
    layout = first.layout
    size = layout.microbatch_size(planner.batch_size)
    table, graph = planner.table(layout), planner.graph(size)
    split_bw = _splits_bw(table)
    blocks = planner.blocks(size, first.fine, exact=True, split_bw=split_bw)
    time_scale, saved_scale = [1.0] * blocks.num_blocks, [1.0] * blocks.num_blocks
    budgets = [planner.limit / layout.stages_per_rank] * layout.num_stages
    bounds, seen, best, last = planner.split(layout, table, blocks).bounds, set(), None, None
    for _ in range(REFINE_ROUNDS):
        stages = planner.exact(size, [blocks.bounds[b] for b in bounds[1:-1]])
        last = planner.evaluate(layout, stages, table, fine=first.fine, bounds=bounds)
        if max(last.rank_memory) <= planner.limit and (best is None or last.step_time < best.step_time):
            best = last
        seen.add(bounds)
        _calibrate(stages, estimate(graph, blocks, bounds), bounds, time_scale, saved_scale, split_bw)
        for rank, peak in enumerate(last.rank_memory):
            for s in table.stages_of(rank) if peak > planner.limit else ():
                budgets[s] *= planner.limit / peak
        try:
            bounds = planner.split(layout, table, blocks, time_scale, saved_scale, budgets).bounds
        except SplitError:
            if best is not None:
                break
            raise
        if bounds in seen and best is not None:
            break
    if best is None:
        raise SplitError(_exact_overflow(last, planner.limit, table))
    return best


def _exact_overflow(cand: Candidate, limit: float, table: schedules.Table) -> str:
    rank = max(range(len(cand.rank_memory)), key=lambda r: cand.rank_memory[r])
    mine = table.stages_of(rank)
    largest = max(cand.stages, key=lambda s: s.saved_bytes + s.b_to_w_bytes)
    return (f"{_describe(cand.layout)}: rank {rank} (stages {list(mine)}) needs {gib(cand.rank_memory[rank])} by "
            f"stage autodiff, the limit is {gib(limit)}; the largest stage keeps "
            f"{gib(largest.saved_bytes + largest.b_to_w_bytes)} of activations per microbatch; make it fit with "
            "more pipeline stages, activation recomputation, or a smaller microbatch (more microbatches per step); "
            "or raise memory_limit")


def _fixed_cuts(planner: Planner, candidates: Sequence[Layout], cuts: Sequence[int]) -> Candidate:
    """The user's cuts, costed exactly, under the fastest layout that fits."""
    best, reasons = None, []
    for layout in candidates:
        size = layout.microbatch_size(planner.batch_size)
        try:
            table = planner.table(layout)
            cand = planner.evaluate(layout, planner.exact(size, cuts), table)
        except (schedules.ScheduleError, ir.IRError) as err:
            raise PlanError(f"cuts {list(cuts)} with {_describe(layout)}: {err}") from err
        if max(cand.rank_memory) > planner.limit:
            reasons.append(_exact_overflow(cand, planner.limit, table))
        elif best is None or cand.step_time < best.step_time:
            best = cand
    if best is None:
        raise SplitError("; ".join(reasons))
    return best


def _to_plan(planner: Planner, cand: Candidate, schedule: str) -> Plan:
    layout = cand.layout
    size = layout.microbatch_size(planner.batch_size)
    graph, table, memory = planner.graph(size), planner.table(layout), planner.memory
    peaks = stage_peaks(table, [s.memory(memory) for s in cand.stages], memory)
    stages = tuple(StagePlan(
        index=k, start=s.start, stop=s.stop, rank=table.rank_of(k), forward_time=s.forward,
        backward_input_time=s.backward_input, backward_weight_time=s.backward_weight, param_bytes=s.param_bytes,
        flops=s.flops, activation_bytes=s.saved_bytes + s.b_to_w_bytes + s.recv_bytes, send_bytes=s.send_bytes,
        peak_memory=int(peaks[k]), names=tuple(graph.input_names[p] for p in s.params),
        num_params=s.num_params) for k, s in enumerate(cand.stages))
    return Plan(
        schedule=schedule, num_stages=layout.num_stages, pipeline_depth=layout.pipeline_depth, dp=layout.dp,
        microbatches=layout.microbatches, cuts=tuple(s.start for s in cand.stages[1:]), stages=stages,
        schedule_options=tuple(sorted(schedule_options(schedule, layout).items())),
        predicted_step_time=cand.step_time, bubble_fraction=cand.bubble, graph_hash=graph_hash(graph),
        device=planner.model.device.name, memory_limit=int(planner.limit), link=planner.model.link.name,
        microbatch_size=size, num_eqns=len(graph.eqns), allreduce_time=cand.allreduce,
        rank_memory=tuple(int(m) for m in cand.rank_memory))


def plan(fn: Any, params: Any, *example_batch: Any, world_size: int = 1, schedule: str = "1f1b",
         stages: int | str | None = None, dp: int | str | None = None, microbatches: int | str = "auto",
         memory_limit: int | None = None, device: str | DeviceProfile = "cpu", stages_per_rank: int | None = None,
         cuts: Sequence[int] | None = None, link: str | LinkProfile | None = None,
         memory_model: MemoryModel | None = None, calibration: Calibration | None = None) -> Plan:
    """Plan `fn(params, *example_batch)` on `world_size` ranks (how: see the module docstring).

    `example_batch` is the full batch (leaves may be tensors, meta tensors or ir.TensorSpec; params too):
    each layout's microbatch is its rows split into dp x microbatches parts. `stages`, `dp` and
    `microbatches` take a count or "auto" (the fastest predicted layout that fits); by default dp = 1 and
    every rank is a pipeline position. `cuts` (equation indices) skip the splitter. `device` is a profile
    name ("h100", "h200", "cpu", "cuda") whose memory is the default `memory_limit` (bytes per rank).
    Raises PlanError for counts that do not fit the world or batch, SplitError when nothing fits memory.
    """
    profile = get_device(device)
    model = CostModel(profile, get_link(link, profile), calibration)
    _check_schedule(schedule)
    if memory_limit is not None and not memory_limit > 0:
        raise PlanError(f"memory_limit is bytes per rank and must be > 0, got {memory_limit!r}; None means the "
                        f"device's {profile.memory_bytes / 1e9:.0f} GB")
    if cuts is not None:
        if isinstance(stages, int) and stages != len(cuts) + 1:
            raise PlanError(f"stages={stages} but {len(cuts)} cuts make {len(cuts) + 1} stages; give one or the other")
        stages = len(cuts) + 1
    v = _stages_per_rank(schedule, stages_per_rank, stages, dp, world_size)
    batch_size = _batch_size(example_batch)
    candidates = layouts(world_size, batch_size, v=v, stages=stages, dp=dp, microbatches=microbatches)
    planner = Planner(fn, params, example_batch, schedule=schedule, model=model, memory=memory_model or MemoryModel(),
                      limit=float(memory_limit if memory_limit is not None else profile.memory_bytes),
                      min_blocks=max(c.num_stages for c in candidates))
    if cuts is not None:
        return _to_plan(planner, _fixed_cuts(planner, candidates, tuple(cuts)), schedule)
    ranked, reasons = _rank_layouts(planner, candidates)
    for cand in ranked:
        try:
            return _to_plan(planner, _refine(planner, cand), schedule)
        except SplitError as err:
            reasons.append(str(err))
    raise SplitError("no layout fits: " + "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else ""))
