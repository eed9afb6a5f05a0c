"""`engine.plan`: trace once per microbatch size, split with the DP, pick the fastest layout, verify it.

One process, no launch: a laptop plans for a cluster. Every candidate layout (pipeline depth, dp,
microbatches) is split on estimated block costs and simulated with its schedule; the fastest that fits in
memory is then made exact: its stages go through stage autodiff, the block estimates are corrected by
what autodiff reports, and the split is redone until it is stable and every rank fits (engine/planning/refine.py).
Each schedule's search is a `Session`; `schedule="auto"` (the default) runs one per candidate (auto.py).

Activation recomputation is chosen per stage inside the split (`stagecost.split_recompute`): with
recompute="auto" a stage recomputes only when it does not fit its budget without, paying its forward
twice; when that happened, the best split without any recomputation is made exact too and the faster
of the two wins. Once a split is exact, `recompute.settle` tries the cheaper level first (norms and
pointwise chains redone, `plan.remat`) where a rank is over the limit or a stage recomputes its whole
forward; with memory to spare no stage recomputes anything.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs

import schedules

from ..errors import PlanError, SplitError, require_function
from ..progress import track
from ..units import nbytes
from . import replicas as replicas_mod
from .artifacts import IncompleteTableError, Planned, Workshop, lowered_table
from .auto import AUTO, pipelined, search_auto
from .calibration import Calibration
from .candidates import (
    MULTI_STAGE_SCHEDULES,
    V_SHAPED,
    Candidate,
    Candidates,
    batch_size_of,
)
from .devices import DeviceProfile, LinkProfile, get_device, get_link
from .floor import above_floor, floor_of
from .layout import Layout, layouts
from .measured import MeasuredScale
from .memory import MemoryModel, rank_terms, with_recipe
from .op_costs import CostModel, graph_hash
from .plan import Plan, StagePlan
from .recipe import Recipe, recipe_of
from .refine import describe, fixed_cuts, refine_auto
from .rows import splits, unsplit
from .stage_costs import recompute_mode
from .tied import tied_model

log = logging.getLogger("engine.plan")
split_log = logging.getLogger("engine.split")


def _stages_per_rank(schedule: str, stages_per_rank: int | None, stages: Any, dp: Any, world_size: int) -> int:
    if schedule in V_SHAPED:
        if stages_per_rank not in (None, 2):
            raise PlanError(f"{schedule} places exactly 2 stages per rank (a V); got stages_per_rank={stages_per_rank}")
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


def schedule_builder(schedule: str) -> Callable[..., schedules.Table] | None:
    """The registered builder of `schedule`, looked up once; PlanError with the registry's closest name.
    None for "auto" (each candidate's own builder)."""
    if schedule == AUTO:
        return None
    try:
        return schedules.get(schedule)
    except (KeyError, ValueError) as err:
        raise PlanError(str(err)) from err


def _rank_layouts(planner: Candidates, candidates: Sequence[Layout]) -> tuple[list[Candidate], list[str]]:
    """Every layout split and simulated on estimates, fastest first; the reasons the others failed."""
    found, reasons = [], []
    for layout in track(candidates, "planning: splitting layouts"):
        try:
            found.append(planner.estimated(layout))
        except IncompleteTableError as err:  # the schedule is broken, not this layout
            raise PlanError(str(err)) from err
        except (SplitError, schedules.ScheduleError) as err:
            reasons.append(f"{describe(layout)}: {err}")
            log.debug("%s does not fit: %s", describe(layout), err)
    found.sort(key=lambda c: (c.step_time, c.layout.num_stages, c.layout.microbatches))
    return found, reasons


def _to_plan(planner: Candidates, cand: Candidate, schedule: str) -> Plan:
    layout = cand.layout
    size = layout.microbatch_size(planner.batch_size)
    graph, table = planner.graph(size), planner.table(layout)
    peaks = cand.stage_memory
    stages = tuple(StagePlan(
        index=k, start=s.start, stop=s.stop, rank=table.rank_of(k), forward_time=s.forward,
        backward_input_time=s.backward_input, backward_weight_time=s.backward_weight, param_bytes=s.param_bytes,
        flops=s.flops, activation_bytes=s.saved_bytes + s.b_to_w_bytes + s.recv_bytes, send_bytes=s.send_bytes,
        peak_memory=int(peaks[k]), names=tuple(graph.input_names[p] for p in s.params),
        num_params=s.num_params) for k, s in enumerate(cand.stages))
    return Plan(
        schedule=schedule, num_stages=layout.num_stages, pipeline_depth=layout.pipeline_depth, dp=layout.dp,
        microbatches=layout.microbatches, cuts=tuple(s.start for s in cand.stages[1:]), stages=stages,
        schedule_options=cand.options or planner.options(layout),
        predicted_step_time=cand.step_time, bubble_fraction=cand.bubble, graph_hash=graph_hash(graph),
        device=planner.model.device.name, memory_limit=int(planner.limit), link=planner.model.link.name,
        microbatch_size=size, num_eqns=len(graph.eqns), allreduce_time=cand.allreduce,
        rank_memory=tuple(int(m) for m in cand.rank_memory), recompute=cand.recompute,
        remat=cand.remat or (False,) * layout.num_stages, shard_optimizer=cand.zero,
        memory_terms=rank_terms(table, cand.stages, planner.memory_for(layout), cand.rank_memory),
        recipe=_recipe_text(planner.memory.recipe), replicas=layout.counts, replica_order=layout.replica_order)


def _recipe_text(recipe: Recipe | None) -> str:
    return "" if recipe is None else ", ".join(f"{k} {v}" for k, v in recipe.to_dict().items() if v is not None)


def search(fn: Any, params: Any, *example_batch: Any, world_size: int = 1, schedule: str = AUTO,
           workshop: Workshop | None = None, has_aux: bool = False, device: str | DeviceProfile = "cpu",
           **options: Any) -> Planned:
    """`plan(...)` with what it computed on the way: the chosen Plan, its microbatch graph, every stage's
    F/B/W programs and the lowered, validated table (`Planned`). `workshop` (tracing and stage autodiff,
    each done once) and `build` (the schedule's builder) may be handed in by a caller that has them.
    `fused_recompute`: the programs will be compiled by a compiler that fuses pointwise work (inductor), so
    the cheap recomputation costs no extra kernels and every stage takes it (`recompute.settle`)."""
    require_function(fn, "engine.plan")
    workshop = workshop or Workshop(fn, params, example_batch, device=get_device(device).kind, has_aux=has_aux)
    blocks: dict[tuple[Any, ...], Any] = {}  # the blocks and their costs, one set for every schedule searched

    def open_session(name: str, build: Callable[..., schedules.Table] | None = None) -> Session:
        return Session.open(fn, params, *example_batch, world_size=world_size, schedule=name, workshop=workshop,
                            device=device, build=build, blocks=blocks, **options)

    if schedule == AUTO:
        options.pop("build", None)
        return search_auto(open_session, stages_per_rank=options.get("stages_per_rank"),
                           pipeline=pipelined(world_size, options.get("dp")))
    return open_session(schedule, options.pop("build", None)).finish()


@attrs.define(eq=False)
class Session:
    """One schedule's search (how: the module docstring): its planner and layouts, ranked on estimates once,
    the best made exact on demand. `search` finishes one; `schedule="auto"` opens one per candidate schedule on
    one Workshop and finishes the one it picks (engine/planning/auto.py)."""

    planner: Candidates
    layouts: list[Layout]
    counts: tuple[int, ...] | str | None
    v: int
    world_size: int
    shape: dict[str, Any]  # the user's stages, dp and microbatches ("auto" or counts)
    cuts: tuple[int, ...] | None
    whole: bool = False  # the loss compares rows (engine/planning/rows.py): only layouts that keep the batch whole
    _ranked: tuple[list[Candidate], list[str]] | None = None
    _exact: Candidate | SplitError | None = None

    @classmethod
    def open(cls, fn: Any, params: Any, *example_batch: Any, world_size: int, schedule: str, workshop: Workshop,
             stages: int | str | None = None, dp: int | str | None = None, microbatches: int | str = "auto",
             memory_limit: int | None = None, device: str | DeviceProfile = "cpu", stages_per_rank: int | None = None,
             cuts: Sequence[int] | None = None, link: str | LinkProfile | None = None,
             memory_model: MemoryModel | None = None, calibration: Calibration | None = None,
             recompute: bool | str = "auto", build: Callable[..., schedules.Table] | None = None,
             fused_recompute: bool = False, recipe: Recipe | None = None, min_microbatch_size: int | None = None,
             replicas: Sequence[int] | str | None = None, blocks: dict[tuple[Any, ...], Any] | None = None,
             measured: MeasuredScale | None = None) -> Session:
        """The planner of `schedule` for these options, checked (PlanError), nothing split yet. `measured`: the
        stage programs' measured / planned seconds (engine.planning.measured), from a plan of the same graph."""
        profile = get_device(device)
        model = CostModel(profile, get_link(link, profile), calibration, measured)  # its region scales: scale_of
        build = build or schedule_builder(schedule)
        assert build is not None
        recompute = recompute_mode(recompute)
        if memory_limit is not None and not memory_limit > 0:
            raise PlanError(f"memory_limit is bytes per rank and must be > 0, got {memory_limit!r}; None means the "
                            f"device's {nbytes(profile.memory_bytes)}")
        if cuts is not None:
            if isinstance(stages, int) and stages != len(cuts) + 1:
                raise PlanError(f"stages={stages} but {len(cuts)} cuts make {len(cuts) + 1} stages; give one or the "
                                "other")
            stages = len(cuts) + 1
        counts = replicas_mod.requested(replicas)
        batch_size = batch_size_of(example_batch)
        v, candidates = _layouts(counts, schedule, stages_per_rank, world_size, batch_size, stages=stages, dp=dp,
                                 microbatches=microbatches)
        candidates = above_floor(candidates, batch_size, *floor_of(fn, min_microbatch_size),
                                 auto=not isinstance(microbatches, int))
        cut = any(splits(lay) for lay in candidates)
        candidates = unsplit(workshop, candidates, batch_size, microbatches=microbatches, dp=dp)  # rows compared
        sizes = dict.fromkeys(lay.microbatch_size(batch_size) for lay in candidates)  # lazily: traced where tied
        model = tied_model(model, (workshop.graph(size) for size in sizes))
        memory = with_recipe(memory_model, recipe_of(recipe), params)
        planner = Candidates(workshop, schedule=schedule, build=build, model=model, memory=memory,
                             limit=float(memory_limit if memory_limit is not None else profile.memory_bytes),
                             min_blocks=max(c.num_stages for c in candidates), recompute=recompute,
                             fused_recompute=fused_recompute, blocks=blocks)
        return cls(planner, candidates, counts, v, world_size, {"stages": stages, "dp": dp,
                                                                "microbatches": microbatches},
                   None if cuts is None else tuple(cuts), whole=cut and not any(splits(lay) for lay in candidates))

    def ranked(self) -> tuple[list[Candidate], list[str]]:
        """Every layout split and simulated on estimates, fastest first, and why the others failed (once)."""
        if self._ranked is None:
            self._ranked = ([], []) if self.cuts is not None else _rank_layouts(self.planner, self.layouts)
        return self._ranked

    def exact(self) -> Candidate:
        """The fastest layout with equal replicas that fits once made exact (the user's cuts, if given);
        SplitError naming why none does."""
        if self._exact is None:
            try:
                self._exact = self._make_exact()
            except SplitError as err:
                self._exact = err
        if isinstance(self._exact, SplitError):
            raise self._exact
        return self._exact

    def _make_exact(self) -> Candidate:
        if self.cuts is not None:
            return fixed_cuts(self.planner, self.layouts, self.cuts)
        ranked, reasons = self.ranked()
        found = _first_fitting(self.planner, ranked, reasons)
        if found is None:
            whole = (f"the loss compares rows of the batch, so the batch is kept whole (one microbatch, dp 1; "
                     f"engine/planning/rows.py), and {self.planner.schedule} cannot run it that way: choose a "
                     "schedule that runs one microbatch (1f1b, gpipe, zbv) or make the loss a mean of per-row "
                     "terms. ") if self.whole else ""
            raise SplitError(whole + "no layout fits: " + "; ".join(reasons[:4]) +
                             (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else ""))
        return found

    def finish(self) -> Planned:
        """The chosen plan: `exact`, or an unequal replica layout where one is predicted REPLICA_GAIN faster."""
        if self.cuts is not None:
            return _chosen(self.planner, self.exact())
        ranked, reasons = self.ranked()
        try:
            best: Candidate | None = self.exact()
        except SplitError:
            best = None
        if replicas_mod.considered(self.counts, self.shape["stages"], self.shape["dp"]):
            proposed = replicas_mod.auto_layouts(self.planner, self.world_size, v=self.v, **self.shape)
            unequal, _ = _rank_layouts(self.planner, [lay for lay in proposed if not (self.whole and splits(lay))])
            if replicas_mod.promising(unequal, ranked, best is None):  # made exact only when the estimates say so
                picked = replicas_mod.choose(best, _first_fitting(self.planner, unequal, reasons))
                if picked is not None:
                    return _chosen(self.planner, *picked)
        return _chosen(self.planner, best if best is not None else self.exact())  # (raises why none fits)


def _layouts(counts: tuple[int, ...] | str | None, schedule: str, stages_per_rank: int | None, world_size: int,
             batch_size: int, *, stages: Any, dp: Any, microbatches: Any) -> tuple[int, list[Layout]]:
    """Stages per rank and the layouts to plan: the user's replica counts, or equal replicas by world and dp."""
    if isinstance(counts, tuple):
        v = _stages_per_rank(schedule, stages_per_rank, stages, 1, len(counts))  # depth: one count per position
        return v, replicas_mod.explicit_layouts(counts, world_size, batch_size, v=v, stages=stages, dp=dp,
                                                microbatches=microbatches)
    v = _stages_per_rank(schedule, stages_per_rank, stages, dp, world_size)
    return v, layouts(world_size, batch_size, v=v, stages=stages, dp=dp, microbatches=microbatches)


def _first_fitting(planner: Candidates, ranked: Sequence[Candidate], reasons: list[str]) -> Candidate | None:
    """The first of the ranked candidates that fits once made exact; why the others did not, in `reasons`."""
    for cand in track(ranked, "planning: exact stage costs"):
        try:
            return refine_auto(planner, cand)
        except SplitError as err:
            reasons.append(str(err))
            log.debug("%s", err)
    return None


def plan(fn: Any, params: Any, *example_batch: Any, **options: Any) -> Plan:
    """Plan `fn(params, *example_batch)` on `world_size` ranks (how: see the module docstring).

    `example_batch` is the full batch (leaves may be tensors, meta tensors or ir.TensorSpec; params too):
    each layout's microbatch is its rows split into dp x microbatches parts. `stages`, `dp` and
    `microbatches` take a count or "auto" (the fastest predicted layout that fits); by default dp = 1 and
    every rank is a pipeline position. `cuts` (equation indices) skip the splitter. `device` is a profile
    name ("h100", "h200", "cpu", "cuda") whose memory is the default `memory_limit` (bytes per rank).
    `recompute` is activation recomputation per stage (F keeps only the stage's outputs, B redoes the
    forward): False never, True on every stage, "auto" only on stages that would not fit memory otherwise
    (`plan.recompute` says which). `min_microbatch_size`: no layout splits the batch into microbatches of
    fewer rows (engine.planning.floor; 16 by default for BatchNorm in train mode). `has_aux=True`: `fn` returns `(loss, aux)` (see `engine.parallelize`);
    otherwise it must return one floating-point scalar that depends on the params (`ir.check_loss` refuses
    anything else with ir.TraceError). `schedule` is a registered name or "auto" (the default): every built-in
    schedule planned, the fastest kept (engine/planning/auto.py). Other options: `world_size` (1),
    `stages_per_rank`, `link`, `memory_model`, `calibration`, `recipe` (engine.Recipe: the optimizer,
    master-weight and grad dtypes and ZeRO-1 the memory is planned for; `plan.shard_optimizer` says
    whether ZeRO-1 was chosen, and print(plan) shows each term of the memory per rank), `replicas` (ranks per pipeline stage, like (2, 1); or
    "auto", the default when stages or dp is "auto": unequal counts where predicted faster; see
    engine.planning.replicas). Raises PlanError for counts that do not fit
    the world or batch, SplitError when nothing fits memory. `search` takes the same and also returns
    the graph, stage programs and lowered table it made on the way.
    """
    return search(fn, params, *example_batch, **options).plan


def _chosen(planner: Candidates, cand: Candidate, equal_step_time: float = 0.0) -> Planned:
    p = attrs.evolve(_to_plan(planner, cand, planner.schedule), equal_step_time=equal_step_time)
    log.info("plan:\n%s", p)
    for name, flags in (("activation recomputation", p.recompute), ("cheap recomputation", p.remat)):
        if any(flags):
            split_log.info("%s on stages %s (memory limit %s)", name, [k for k, r in enumerate(flags) if r],
                           nbytes(p.memory_limit or 0))
    size = p.microbatch_size
    return Planned(p, planner.graph(size), lambda: planner.workshop.stages(size, p.cuts, p.recompute, p.remat),
                   lowered_table(p, planner.build), planner.workshop.finish)
