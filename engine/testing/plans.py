"""`plans()`: a hypothesis strategy of valid pipeline layouts (`PlanSpec`) for the equivalence harness.

A `PlanSpec` is model-independent: schedule, stage count, microbatches, data-parallel degree, stages
per rank, and how the model is cut, either as explicit equation indices (`cuts`), as relative stage
sizes (`weights`, resolved against the model's equation count), or left to the splitter (neither).

    @given(engine.testing.plans(batch_size=16))
    def test_equivalent(spec):
        engine.testing.assert_parallel_equivalent(loss_fn, params, x, y, plan=spec)

Schedules are drawn from `schedules.names()` when the example is drawn, so a schedule registered with
`schedules.register` before the test runs is drawn too (with one stage per rank; see `plans`).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

import attrs
import torch
from hypothesis import assume
from hypothesis import strategies as st

import ir
import schedules as _schedules

from ..errors import PlanError
from ..planning.plan import Plan, StagePlan
from ..planning.candidates import MULTI_STAGE_SCHEDULES

__all__ = ["CUT_MODES", "PlanSpec", "default_world_sizes", "cut_points", "models_and_plans", "plans", "weights_to_cuts"]

CUT_MODES = ("drawn", "splitter", "both")
MAX_WEIGHT = 32  # drawn stage weights are 1..MAX_WEIGHT; all equal (the shrink target) is an even split


def _positive(instance: Any, attribute: Any, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"PlanSpec.{attribute.name} must be an int >= 1, got {value!r}")


def _opt_tuple(x: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if x is None else tuple(int(i) for i in x)


@attrs.frozen
class PlanSpec:
    """A layout to check a model on: `stages = pipeline_depth * stages_per_rank`, `world = depth * dp`.

    `cuts` are equation indices of the microbatch graph (stage k starts at `cuts[k-1]`); `weights` are
    relative stage sizes in equations; with neither, the planner's splitter chooses the cuts.
    """

    schedule: str
    stages: int = attrs.field(validator=_positive)
    microbatches: int = attrs.field(validator=_positive)
    dp: int = attrs.field(default=1, validator=_positive)
    stages_per_rank: int = attrs.field(default=1, validator=_positive)
    cuts: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)
    weights: tuple[int, ...] | None = attrs.field(default=None, converter=_opt_tuple)

    def __attrs_post_init__(self) -> None:
        if self.stages % self.stages_per_rank:
            raise PlanError(f"PlanSpec: {self.stages} stages do not split into {self.stages_per_rank} per rank")
        if self.cuts is not None and self.weights is not None:
            raise PlanError("PlanSpec takes cuts or weights, not both")
        if self.cuts is not None and len(self.cuts) != self.stages - 1:
            raise PlanError(f"PlanSpec: {len(self.cuts)} cuts make {len(self.cuts) + 1} stages, not {self.stages}")
        if self.weights is not None and (len(self.weights) != self.stages or min(self.weights) < 1):
            raise PlanError(f"PlanSpec: weights {self.weights} must be {self.stages} ints >= 1, one per stage")

    @property
    def pipeline_depth(self) -> int:
        return self.stages // self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.pipeline_depth * self.dp

    @property
    def schedule_options(self) -> tuple[tuple[str, Any], ...]:
        key = MULTI_STAGE_SCHEDULES.get(self.schedule)
        return ((key, self.stages_per_rank),) if key else ()

    def __str__(self) -> str:
        v = f" ({self.stages_per_rank} per rank)" if self.stages_per_rank > 1 else ""
        how = (f", cuts {list(self.cuts)}" if self.cuts is not None else
               f", stage weights {':'.join(map(str, self.weights))}" if self.weights is not None else ", splitter cuts")
        return (f"{self.schedule}: {self.stages} stages{v} on {self.pipeline_depth} ranks x dp {self.dp}, "
                f"{self.microbatches} microbatches{how}")

    def resolve_cuts(self, num_eqns: int) -> tuple[int, ...] | None:
        """The cuts for a graph of `num_eqns` equations (None: the splitter chooses)."""
        if self.stages > num_eqns:
            raise PlanError(f"{self.stages} stages need at least {self.stages} equations; the model has {num_eqns}; "
                            f"draw plans(num_eqns={num_eqns}) or fewer stages")
        if self.cuts is not None:
            inside = not self.cuts or 0 < self.cuts[0] <= self.cuts[-1] < num_eqns
            if list(self.cuts) != sorted(set(self.cuts)) or not inside:
                raise PlanError(f"cuts {list(self.cuts)} must increase strictly within 1..{num_eqns - 1}")
            return self.cuts
        if self.weights is None:
            return None
        return weights_to_cuts(self.weights, num_eqns)

    def to_plan(self, fn: Callable, params: Any, *batch: Any, planner: bool = False) -> Plan:
        """The engine.Plan of this spec for `fn(params, *batch)` (`batch` is the full batch). Without cuts or
        weights the planner's splitter chooses them; with them the Plan is built directly (no costs, ~100x
        faster), or by the planner given the cuts when `planner` is set (as `engine.parallelize` does)."""
        from ..planning.search import search
        from ._cache import graph_of, workshop_of

        parts = self.microbatches * self.dp
        graph = graph_of(fn, params, batch, parts)
        cuts = self.resolve_cuts(len(graph.eqns))
        if cuts is None or planner:
            return search(fn, params, *batch, world_size=self.world_size, schedule=self.schedule, stages=self.stages,
                          dp=self.dp, microbatches=self.microbatches, stages_per_rank=self.stages_per_rank,
                          cuts=cuts or None, workshop=workshop_of(fn, params, batch), min_microbatch_size=1).plan
        return _hand_plan(self, graph, cuts, _batch_size(batch) // parts)


def weights_to_cuts(weights: Sequence[int], num_eqns: int) -> tuple[int, ...]:
    """Cut points splitting `num_eqns` equations in proportion to `weights`, each stage at least one."""
    total, acc, cuts = sum(weights), 0, []
    n = len(weights)
    for k, w in enumerate(weights[:-1]):
        acc += w
        cut = round(num_eqns * acc / total)
        lo = (cuts[-1] if cuts else 0) + 1
        cuts.append(min(max(cut, lo), num_eqns - (n - 1 - k)))
    return tuple(cuts)


def _batch_size(batch: Sequence[Any]) -> int:
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves(tuple(batch))
    return int(leaves[0].shape[0]) if leaves and isinstance(leaves[0], torch.Tensor) and leaves[0].dim() else 0


def _hand_plan(spec: PlanSpec, graph: ir.Graph, cuts: tuple[int, ...], mb_size: int) -> Plan:
    table = _schedules.get(spec.schedule)(spec.stages, spec.microbatches, **dict(spec.schedule_options))
    bounds = (0, *cuts, len(graph.eqns))
    params = set(graph.inputs[:graph.num_params])
    names = dict(zip(graph.inputs, graph.input_names))
    stages = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        read = dict.fromkeys(v for e in graph.eqns[a:b] for v in e.inputs if v in params)
        stages.append(StagePlan(k, a, b, table.rank_of(k), names=tuple(names.get(v, "?") for v in read)))
    return Plan(spec.schedule, spec.stages, spec.pipeline_depth, spec.dp, spec.microbatches, cuts, tuple(stages),
                schedule_options=spec.schedule_options, microbatch_size=mb_size, num_eqns=len(graph.eqns))


# ---------------------------------------------------------------- drawing


def default_world_sizes() -> tuple[int, ...]:
    """(1, 2, 4) in one process; the job's world size under mpirun or torchrun."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if int(os.environ.get(var, "1")) > 1:
            return (int(os.environ[var]),)
    return (1, 2, 4)


@functools.lru_cache(maxsize=4096)
def _layouts(fn: Callable, name: str, p: int, dp: int, max_v: int, max_m: int, batch_size: int | None,
             max_stages: int | None) -> tuple[tuple[int, int], ...]:
    """Every (stages_per_rank, microbatches) the schedule accepts on `p` ranks (the table builds with p rows)."""
    key = MULTI_STAGE_SCHEDULES.get(name) or ""
    vs = range(1, max_v + 1) if name in MULTI_STAGE_SCHEDULES else (1,)
    out = []
    for v in vs:
        if max_stages is not None and p * v > max_stages:
            continue
        for m in range(1, max_m + 1):
            if batch_size is not None and (batch_size % dp or (batch_size // dp) % m):
                continue
            try:
                table = fn(p * v, m, **({key: v} if key else {}))
            except (_schedules.ScheduleError, ValueError):
                continue
            if table.num_ranks == p and table.num_stages == p * v:
                out.append((v, m))
    return tuple(out)


@st.composite
def plans(draw: Any, world_sizes: Sequence[int] | None = None, schedules: Sequence[str] | None = None, *,
          dps: Sequence[int] = (1, 2), max_microbatches: int = 8, max_stages_per_rank: int = 3,
          batch_size: int | None = None, num_eqns: int | None = None, cuts: str = "both") -> PlanSpec:
    """Valid `PlanSpec`s: a schedule from `schedules` (default: every registered one, looked up per draw),
    a world size from `world_sizes` (default `default_world_sizes()`), dp from `dps` dividing it, and
    stages per rank / microbatches the schedule accepts on the remaining pipeline depth: zbv and dualpipev (m >= 2p)
    take 2 stages per rank, interleaved-1f1b (microbatches a multiple of the depth), looped-bfs and interleaved-zb
    1..max_stages_per_rank, the others
    (and schedules you registered) one; a combination is kept when the schedule function builds a table
    with that many ranks. `batch_size`: keep microbatches x dp dividing it. `num_eqns`: the model's
    equation count (at most that many stages; cuts drawn as equation indices). `cuts`: "drawn" (explicit
    cuts, or stage weights without `num_eqns`), "splitter" (the planner chooses) or "both".
    """
    if cuts not in CUT_MODES:
        raise ValueError(f"cuts must be one of {CUT_MODES}, got {cuts!r}")
    name = draw(st.sampled_from(tuple(schedules or _schedules.names())))
    world = draw(st.sampled_from(tuple(world_sizes or default_world_sizes())))
    dp = draw(st.sampled_from([d for d in dps if world % d == 0] or [1]))
    p = world // dp
    options = _layouts(_schedules.get(name), name, p, dp, max_stages_per_rank, max_microbatches, batch_size, num_eqns)
    assume(bool(options))  # e.g. zbv with more stages than the model has equations
    v, m = draw(st.sampled_from(options))
    n_stages = p * v
    mode = draw(st.sampled_from(("drawn", "splitter"))) if cuts == "both" else cuts
    if mode == "splitter" or n_stages == 1:
        return PlanSpec(name, n_stages, m, dp, v, cuts=() if n_stages == 1 else None)
    if num_eqns is not None:
        return PlanSpec(name, n_stages, m, dp, v, cuts=draw(cut_points(n_stages, num_eqns)))
    weights = draw(st.lists(st.integers(1, MAX_WEIGHT), min_size=n_stages, max_size=n_stages))
    return PlanSpec(name, n_stages, m, dp, v, weights=tuple(weights))


def cut_points(stages: int, num_eqns: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Increasing cut indices within 1..num_eqns-1 making `stages` stages."""
    return st.lists(st.integers(1, num_eqns - 1), min_size=stages - 1, max_size=stages - 1,
                    unique=True).map(lambda c: tuple(sorted(c)))


@st.composite
def models_and_plans(draw: Any, cases: st.SearchStrategy[Any] | None = None,
                     **plan_options: Any) -> tuple[Any, PlanSpec]:
    """`(case, spec)`: a `ModelCase` from `cases` (default `models()`) and a plan fitted to it: microbatches x
    dp divide its batch, and drawn cuts are equation indices of its microbatch graph (traced once here, at
    the plan's microbatch size, so the harness finds it cached). `plan_options` go to `plans`."""
    from ._cache import graph_of
    from .models import models

    case = draw(cases if cases is not None else models())
    spec = draw(plans(batch_size=_batch_size(case.batch), **plan_options))
    if spec.weights is None:
        return case, spec
    graph = graph_of(case.fn, case.params, case.batch, spec.microbatches * spec.dp)
    assume(spec.stages <= len(graph.eqns))
    return case, attrs.evolve(spec, weights=None, cuts=draw(cut_points(spec.stages, len(graph.eqns))))
