"""`engine.plan`: trace once per microbatch size, split with the DP, pick the fastest layout, verify it.

One process, no launch: a laptop plans for a cluster. Every candidate layout (pipeline depth, dp,
microbatches) is split on estimated block costs and simulated with its schedule; the fastest that fits in
memory is then made exact: its stages go through stage autodiff, the block estimates are corrected by
what autodiff reports, and the split is redone until it is stable and every rank fits.

Activation recomputation is chosen per stage inside the split (`stagecost.split_recompute`): with
recompute="auto" a stage recomputes only when it does not fit its budget without, paying its forward
twice; when that happened, the best split without any recomputation is made exact too and the faster
of the two wins.
"""
from __future__ import annotations

import logging
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
from .progress import track
from .split import BlockCosts, Partition
from .stagecost import (RecomputeCosts, StageCost, estimate, exact, exact_blocks, recompute_mode,
                        schedule_costs, split_recompute, splits_bw)

log = logging.getLogger("engine.plan")
split_log = logging.getLogger("engine.split")

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
    recompute: tuple[bool, ...] = ()


class Planner:
    """Caches per microbatch size (graph, blocks, exact stage costs) while layouts are tried."""

    def __init__(self, fn: Any, params: Any, batch: Sequence[Any], *, schedule: str, model: CostModel,
                 memory: MemoryModel, limit: float, min_blocks: int, recompute: bool | str = False) -> None:
        self.fn, self.params, self.batch = fn, params, tuple(batch)
        self.recompute = recompute
        self.schedule, self.model, self.memory, self.limit = schedule, model, memory, limit
        self.min_blocks = min_blocks
        self.trace_device = "cuda" if model.device.kind == "cuda" and torch.cuda.is_available() else "cpu"
        self._graphs: dict[int, ir.Graph] = {}
        self._blocks: dict[tuple[int, bool, bool, bool], Blocks] = {}
        self._exact: dict[int, dict[tuple[int, int, bool], StageCost]] = {}

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

    def exact(self, size: int, cuts: Sequence[int], recompute: Sequence[bool] = ()) -> tuple[StageCost, ...]:
        cache = self._exact.setdefault(size, {})
        return exact(self.graph(size), cuts, self.model, device=self.trace_device, cache=cache, recompute=recompute)

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
        peaks = rank_peaks(table, [s.memory(self.memory, split_bw=splits_bw(table)) for s in stages], self.memory)
        return Candidate(layout, fine, bounds, stages, sim.makespan + allreduce, sim.makespan, sim.bubble_fraction,
                         allreduce, peaks, tuple(s.recompute for s in stages))

    def split(self, layout: Layout, table: schedules.Table, blocks: Blocks, time_scale: Sequence[float] | None = None,
              saved_scale: Sequence[float] | None = None, budgets: Sequence[float] | None = None
              ) -> tuple[Partition, tuple[bool, ...]]:
        """The fastest split of this layout's `blocks` whose stages fit their budgets, and which of its
        stages recompute their activations (see `stagecost.split_recompute`)."""
        rc = self.recompute_costs(blocks, time_scale, saved_scale)
        budgets = budgets or [self.limit / layout.stages_per_rank] * layout.num_stages
        labels = [_block_label(blocks, k) for k in range(blocks.num_blocks)]
        return split_recompute(rc, layout.num_stages, mode=self.recompute, live=peak_live(table), budgets=budgets,
                               memory=self.memory, names=labels)

    def recompute_costs(self, blocks: Blocks, time_scale: Sequence[float] | None = None,
                        saved_scale: Sequence[float] | None = None) -> RecomputeCosts:
        ones = [1.0] * blocks.num_blocks
        time_scale = time_scale or ones
        costs = self.block_costs(blocks, time_scale, saved_scale or ones)
        return RecomputeCosts(costs, tuple(blocks.forward[k] * time_scale[k] for k in range(blocks.num_blocks)))

    def block_peaks(self, table: schedules.Table, blocks: Blocks, bounds: Sequence[int], recompute: Sequence[bool],
                    time_scale: Sequence[float], saved_scale: Sequence[float]) -> list[float]:
        """Each stage's peak as the splitter sees it (block sums), to compare with the exact one."""
        rc, live = self.recompute_costs(blocks, time_scale, saved_scale), peak_live(table)
        return [rc.peak(i, j, live[k], self.memory) if recompute[k] else rc.costs.stage_peak(i, j, live[k], self.memory)
                for k, (i, j) in enumerate(zip(bounds, bounds[1:]))]

    @property
    def batch_size(self) -> int:
        return _batch_size(self.batch)

    def estimated(self, layout: Layout) -> Candidate:
        """The layout split and simulated on block estimates (SplitError when nothing fits). Cuts stay
        between modules unless cutting inside them makes the slowest stage INNER_CUT_GAIN faster."""
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
        raise PlanError(str(err)) from err  # the registry's message names the known schedules and the closest


def _rank_layouts(planner: Planner, candidates: Sequence[Layout]) -> tuple[list[Candidate], list[str]]:
    """Every layout split and simulated on estimates, fastest first; the reasons the others failed."""
    found, reasons = [], []
    for layout in track(candidates, "planning: splitting layouts"):
        try:
            found.append(planner.estimated(layout))
        except (SplitError, schedules.ScheduleError) as err:
            reasons.append(f"{_describe(layout)}: {err}")
            log.debug("%s does not fit: %s", _describe(layout), err)
    found.sort(key=lambda c: (c.step_time, c.layout.num_stages, c.layout.microbatches))
    return found, reasons


def _describe(layout: Layout) -> str:
    return (f"{layout.num_stages} stages on {layout.pipeline_depth} ranks x dp {layout.dp}, "
            f"{layout.microbatches} microbatches")


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


def _refine(planner: Planner, first: Candidate) -> Candidate:
    """Make a candidate exact: stage autodiff for its stages, recalibrate the blocks, re-split until stable."""
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
        stages = planner.exact(size, [blocks.bounds[b] for b in bounds[1:-1]], flags)
        last = planner.evaluate(layout, stages, table, fine=first.fine, bounds=bounds)
        if max(last.rank_memory) <= planner.limit and (best is None or last.step_time < best.step_time):
            best = last
        seen.add((bounds, flags))
        _calibrate(stages, estimate(graph, blocks, bounds, recompute=flags), bounds, time_scale, saved_scale,
                   split_bw)
        seen_peaks = planner.block_peaks(table, blocks, bounds, flags, time_scale, saved_scale)
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
    return best


def _refine_auto(planner: Planner, first: Candidate) -> Candidate:
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
    return (f"{_describe(cand.layout)}: rank {rank} (stages {list(mine)}) needs {gib(cand.rank_memory[rank])} by "
            f"stage autodiff{done}, the limit is {gib(limit)}; the largest stage keeps "
            f"{gib(largest.saved_bytes + largest.b_to_w_bytes)} of activations per microbatch; {fix}")


def _fixed_cuts(planner: Planner, candidates: Sequence[Layout], cuts: Sequence[int]) -> Candidate:
    """The user's cuts, costed exactly, under the fastest layout that fits."""
    best, reasons = None, []
    for layout in candidates:
        size = layout.microbatch_size(planner.batch_size)
        try:
            table = planner.table(layout)
            cand = _fixed_recompute(planner, layout, table, size, cuts)
        except (schedules.ScheduleError, ir.IRError) as err:
            raise PlanError(f"cuts {list(cuts)} with {_describe(layout)}: {err}") from err
        if max(cand.rank_memory) > planner.limit:
            reasons.append(_exact_overflow(cand, planner.limit, table, planner.recompute))
        elif best is None or cand.step_time < best.step_time:
            best = cand
    if best is None:
        raise SplitError("; ".join(reasons))
    return best


def _fixed_recompute(planner: Planner, layout: Layout, table: schedules.Table, size: int,
                     cuts: Sequence[int]) -> Candidate:
    """Fixed cuts costed exactly; with recompute "auto", the stages of each rank over the limit
    recompute (until every rank fits or all its stages do)."""
    flags = [planner.recompute is True] * layout.num_stages
    while True:
        cand = planner.evaluate(layout, planner.exact(size, cuts, flags), table)
        over = [s for r, peak in enumerate(cand.rank_memory) if peak > planner.limit for s in table.stages_of(r)
                if not flags[s]]
        if planner.recompute != "auto" or not over:
            return cand
        for s in over:
            flags[s] = True


def _to_plan(planner: Planner, cand: Candidate, schedule: str) -> Plan:
    layout = cand.layout
    size = layout.microbatch_size(planner.batch_size)
    graph, table, memory = planner.graph(size), planner.table(layout), planner.memory
    peaks = stage_peaks(table, [s.memory(memory, split_bw=splits_bw(table)) for s in cand.stages], memory)
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
        rank_memory=tuple(int(m) for m in cand.rank_memory), recompute=cand.recompute)


def plan(fn: Any, params: Any, *example_batch: Any, world_size: int = 1, schedule: str = "1f1b",
         stages: int | str | None = None, dp: int | str | None = None, microbatches: int | str = "auto",
         memory_limit: int | None = None, device: str | DeviceProfile = "cpu", stages_per_rank: int | None = None,
         cuts: Sequence[int] | None = None, link: str | LinkProfile | None = None,
         memory_model: MemoryModel | None = None, calibration: Calibration | None = None,
         recompute: bool | str = "auto") -> Plan:
    """Plan `fn(params, *example_batch)` on `world_size` ranks (how: see the module docstring).

    `example_batch` is the full batch (leaves may be tensors, meta tensors or ir.TensorSpec; params too):
    each layout's microbatch is its rows split into dp x microbatches parts. `stages`, `dp` and
    `microbatches` take a count or "auto" (the fastest predicted layout that fits); by default dp = 1 and
    every rank is a pipeline position. `cuts` (equation indices) skip the splitter. `device` is a profile
    name ("h100", "h200", "cpu", "cuda") whose memory is the default `memory_limit` (bytes per rank).
    `recompute` is activation recomputation per stage (F keeps only the stage's outputs, B redoes the
    forward): False never, True on every stage, "auto" only on stages that would not fit memory otherwise
    (`plan.recompute` says which). Raises PlanError for counts that do not fit the world or batch,
    SplitError when nothing fits memory.
    """
    profile = get_device(device)
    model = CostModel(profile, get_link(link, profile), calibration)
    _check_schedule(schedule)
    recompute = recompute_mode(recompute)
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
                      min_blocks=max(c.num_stages for c in candidates), recompute=recompute)
    if cuts is not None:
        return _chosen(_to_plan(planner, _fixed_cuts(planner, candidates, tuple(cuts)), schedule))
    ranked, reasons = _rank_layouts(planner, candidates)
    for cand in track(ranked, "planning: exact stage costs"):
        try:
            return _chosen(_to_plan(planner, _refine_auto(planner, cand), schedule))
        except SplitError as err:
            reasons.append(str(err))
            log.debug("%s", err)
    raise SplitError("no layout fits: " + "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else ""))


def _chosen(p: Plan) -> Plan:
    log.info("plan:\n%s", p)
    if any(p.recompute):
        split_log.info("activation recomputation on stages %s (memory limit %s)",
                       [k for k, r in enumerate(p.recompute) if r], gib(p.memory_limit or 0))
    return p
