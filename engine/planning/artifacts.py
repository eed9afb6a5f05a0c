"""What planning computes and hands on: graphs per microbatch size, stage programs per cut, the Planned result.

Tracing and stage autodiff are the expensive passes of planning. A `Workshop` does each once: one
trace per microbatch size, one `ir.stage_autodiff` per (microbatch size, equation range, recompute level),
whatever cut sets the splitter, the exact costing or the assembly ask for. `Planned` is the chosen
Plan together with its graph, its stages' F/B/W programs and its lowered, validated table: execution
assembles programs from it without tracing or differentiating again.

Two kinds of joint graphs, for two uses. The search costs hundreds of candidate stages; tracing each
one's joint (make_fx, about a millisecond per ATen op: 7 s for five 70 B layers) was most of planning.
`costing` differentiates a candidate on a joint stitched from its blocks' traced joints (`ir.stitch`:
each distinct block traced once, the same equations, tests/engine/test_stitch.py holds the costs equal).
The programs that run are stitched too (`running`), from pieces between the graph's module cuts and the
plan's cuts, so every path to a plan (a search, a plan cache's hit, the test tools) builds the same ones;
a stage whose joint is not its pieces' is traced. They are built when a Step first asks for them
(`Planned.stages`), so `engine.plan` never differentiates a chosen stage.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

import ir
import schedules
from ir import stitch
from ir.autodiff import diff_positions, joint_key, recompute_level

from ..errors import PlanError
from .blocks import crossing_bytes, module_cuts
from .joints import JOINTS, STITCHED, Stitched, WorkshopJoints
from .plan import Plan
from .rows import check_plan

log = logging.getLogger("engine.plan")


@attrs.frozen(eq=False)
class StageInfo:
    """One stage: its slice of the graph and its F/B/W programs (what the emitter and runtime need)."""

    stage: ir.Stage
    ad: ir.StageAD

    @property
    def n_params(self) -> int:
        return len(self.stage.param_ids)

    @property
    def n_batch(self) -> int:
        return len(self.stage.batch_ids)

    def act_slot(self, k: int) -> int:
        """Slot of the k-th received activation."""
        return self.n_params + self.n_batch + k

    def grad_acts(self) -> list[int]:
        """Indices k of acts_in that get a gradient sent back (float activations)."""
        return [k for k in range(len(self.stage.acts_in)) if self.ad.grad_slots[self.act_slot(k)] is not None]

    def ct_outs(self) -> list[int]:
        """Indices j of acts_out that receive a cotangent (float activations)."""
        return [j for j in range(len(self.stage.acts_out)) if self.ad.ct_slots[j] is not None]

    @property
    def loss_index(self) -> int:
        """On the last stage, the position of the loss among the stage graph's outputs (its aux leaves follow)."""
        return len(self.stage.acts_out)

    def aux_indices(self) -> range:
        """On the last stage, the positions of the loss function's aux leaves among the outputs (none elsewhere)."""
        return range(self.loss_index + 1, len(self.stage.graph.outputs)) if self.stage.is_last else range(0)

    def recv_aval(self, what: str, k: int) -> ir.AbstractValue:
        """Shape and dtype of the k-th buffer that a receive of `what` ("act" or "grad") fills."""
        g = self.stage.graph
        if what == "act":
            return g.inputs[self.act_slot(k)].aval
        return g.outputs[self.ct_outs()[k]].aval


def _signature(st: ir.Stage) -> tuple[Any, ...]:
    """What a stage's programs depend on besides its graph: its interface to the other stages."""
    return (st.start, st.stop, st.param_ids, st.batch_ids, st.acts_in, st.acts_out, st.frozen_in, st.frozen_out)


class Workshop:
    """Traces `fn` once per microbatch size and differentiates each stage once; everything is kept.

    `device` is the device type the programs will run on ("cpu", "cuda"): without an index, so every
    rank traces the same graph and factory ops land on each rank's current device.
    """

    def __init__(self, fn: Callable, params: Any, batch: Sequence[Any], *, device: str = "cpu",
                 has_aux: bool = False) -> None:
        self.fn, self.params, self.batch, self.device, self.has_aux = fn, params, tuple(batch), device, has_aux
        parts = ir.deferred_of(fn)  # a deferred aux (BatchNorm's running statistics): trace the microbatch half
        if parts is not None and not has_aux:
            raise PlanError(f"{getattr(fn, '__name__', 'loss_fn')} returns (loss, state) (e.g. engine.functionalize "
                            "of a module with BatchNorm in train mode: the new running statistics); pass has_aux=True, "
                            "and the step returns ((loss, state), grads)")
        self.traced = parts.local if parts is not None else fn
        self.finish = parts.finish if parts is not None else None
        self._graphs: dict[int, ir.Graph] = {}
        self.trace_seconds = 0.0  # wall seconds spent tracing `fn` (engine.setup_clock)
        self._mixed: dict[int, ir.MixedRows | None] = {}
        self._ads: dict[tuple[Any, ...], ir.StageAD] = {}
        self._alike: dict[tuple[Any, ...], ir.StageAD] = {}
        self._joints = WorkshopJoints(JOINTS)  # traced joints: of a stage's recompute levels, and the process's
        # blocks as pieces, joints stitched from theirs, the programs of those: for costing (`costing`)
        self._pieces: dict[tuple[int, tuple[int, ...]], dict[int, tuple[int, stitch.Piece]]] = {}
        self._stitched = WorkshopJoints(STITCHED)  # (joint key, pieces' bounds) -> Stitched, and the process's
        self._costed: dict[tuple[Any, ...], ir.StageAD] = {}
        self._alike_costed: dict[tuple[Any, ...], ir.StageAD] = {}
        # the programs a plan's stages run (`running`): stitched on bounds from the graph and the plan's cuts
        self._running: dict[tuple[Any, ...], ir.StageAD] = {}
        self._alike_running: dict[tuple[Any, ...], ir.StageAD] = {}

    def graph(self, size: int) -> ir.Graph:
        """The graph of one microbatch of `size` rows, checked against the loss contract (`ir.check_loss`)."""
        if size not in self._graphs:
            specs = pytree.tree_map(lambda x: microbatch_spec(x, size), self.batch)
            started = time.perf_counter()
            graph = ir.trace(self.traced, self.params, *specs, device=self.device)
            self.trace_seconds += time.perf_counter() - started
            self._graphs[size] = ir.check_loss(graph, has_aux=self.has_aux, name=getattr(self.fn, "__name__", "loss_fn"))
        return self._graphs[size]

    def mixed_rows(self, size: int) -> ir.MixedRows | None:
        """The first op of the loss that mixes the batch's rows (`ir.mixed_rows`) in the graph of `size` rows, or
        of 2 for a size of 1 (with one row the rows' dim looks like any dim of size 1), with its source line."""
        size = max(size, 2)
        if size not in self._mixed:
            found = ir.mixed_rows(self.graph(size), own_norms=self.finish is not None)
            self._mixed[size] = found if found is None or found.source else self._located(size, found)
            if found is None:
                self._warn_aux(size)
        return self._mixed[size]

    def _warn_aux(self, size: int) -> None:
        """Log an aux leaf that mixes the batch's rows: the step returns the parts' average of it (a metric such
        as `loss.exp()` or `logits.max()`), which the user may not expect; the loss and grads stay exact."""
        g = self.graph(size)
        if len(g.outputs) > 1:
            found = ir.mixed_rows(g, outputs=range(1, len(g.outputs)), own_norms=self.finish is not None)
            if found is not None:
                log.warning("an aux output mixes rows of the batch (%s): the step returns the average of its "
                            "value over the microbatches and dp replicas, not its value on the whole batch", found)

    def _located(self, size: int, found: ir.MixedRows) -> ir.MixedRows:
        """`found` with its source line, from the function traced again with lines (only for an error)."""
        specs = pytree.tree_map(lambda x: microbatch_spec(x, size), self.batch)
        try:
            again = ir.mixed_rows(ir.trace(self.traced, self.params, *specs, device=self.device, lines=True),
                                  own_norms=self.finish is not None)
        except Exception:  # noqa: BLE001 -- the line is a hint; the refusal stands without it
            return found
        return again if again is not None and again.index == found.index else found

    def autodiff(self, size: int, stage: ir.Stage, recompute: bool | str = False) -> ir.StageAD:
        """Stage autodiff of `stage` (a slice of `graph(size)`) at a recompute level (False, "cheap",
        True), made once per range and interface, and shared by stages whose graphs print alike (the
        middle stages of a model of identical layers): a stage's programs depend on its graph's structure
        alone, not on which leaves feed it."""
        level = recompute_level(recompute)
        key = (size, _signature(stage), level)
        if key not in self._ads:
            alike = (ir.program_digest(stage.graph), len(stage.param_ids), len(stage.batch_ids), len(stage.acts_out),
                     stage.frozen_in, stage.frozen_out, stage.is_last, level)
            if alike not in self._alike:
                self._alike[alike] = autodiff(stage, level, device=self.device, joints=self._joints)
            self._ads[key] = self._alike[alike]
        return self._ads[key]

    def costing(self, size: int, stage: ir.Stage, recompute: bool | str, bounds: Sequence[int]) -> ir.StageAD:
        """Stage autodiff for costing a candidate stage: of a joint stitched from the traced joints of the
        pieces (blocks between `bounds`, equation indices) it spans (`ir.stitch`), so a stage of N alike
        layers costs one layer's trace (a piece is traced without the values that only pass through it, so
        blocks alike but for those share it too). A stage whose cuts are not among `bounds`, or whose joint is
        not its pieces' (`stitch.NotStitchable`), is traced (`autodiff`)."""
        level = recompute_level(recompute)
        key = (size, _signature(stage), level)
        if key in self._ads:
            return self._ads[key]
        if key not in self._costed:
            self._costed[key] = self._stitched_or_traced(size, stage, level, tuple(bounds), self._alike_costed)
        return self._costed[key]

    def running(self, size: int, stage: ir.Stage, recompute: bool | str, cuts: Sequence[int]) -> ir.StageAD:
        """The programs stage `stage` of a plan cut at `cuts` runs: stitched from the pieces between the graph's
        module cuts and the plan's cuts (`blocks.module_cuts`: bounds from the graph alone, so a fresh search, a
        plan cache's hit and the test tools build the same programs), or traced where the stage's joint is not
        its pieces' (`stitch.NotStitchable`). Tracing each stage's joint took 9-13 s of a 0.85 B Llama's warm
        restart (35-42 s, 2 x H100, 2026-11-27); stitched, each distinct block is traced once."""
        level = recompute_level(recompute)
        key = (size, _signature(stage), level, tuple(cuts))
        if key not in self._running:
            g = self.graph(size)
            bounds = tuple(sorted({0, len(g.eqns), *module_cuts(g, crossing_bytes(g)), *cuts}))
            self._running[key] = self._stitched_or_traced(size, stage, level, bounds, self._alike_running, run=True)
        return self._running[key]

    def _stitched_or_traced(self, size: int, stage: ir.Stage, level: bool | str, bounds: tuple[int, ...],
                            alike_cache: dict[tuple[Any, ...], ir.StageAD], *, run: bool = False) -> ir.StageAD:
        pieces = self._pieces_in(size, bounds, stage)
        if pieces is None:
            return self.autodiff(size, stage, level)
        inside = tuple(b - stage.start for b in bounds if stage.start <= b <= stage.stop)  # the pieces' bounds
        alike = (ir.program_digest(stage.graph), len(stage.param_ids), len(stage.batch_ids), len(stage.acts_out),
                 stage.frozen_in, stage.frozen_out, stage.is_last, level, inside)
        if alike not in alike_cache:
            found = self._stitch(stage, pieces, level, inside, run=run)
            alike_cache[alike] = found if found is not None else self.autodiff(size, stage, level)
        return alike_cache[alike]

    def _pieces_in(self, size: int, bounds: tuple[int, ...], stage: ir.Stage) -> list[stitch.Piece] | None:
        if (size, bounds) not in self._pieces:
            blocks = ir.split(self.graph(size), bounds[1:-1])
            self._pieces[(size, bounds)] = {b.start: (b.stop, stitch.piece_of(b)) for b in blocks}
        at, out, start = self._pieces[(size, bounds)], [], stage.start
        while start < stage.stop and start in at:
            start, piece = at[start]
            out.append(piece)
        return out if start == stage.stop and out else None

    def _stitch(self, stage: ir.Stage, pieces: Sequence[stitch.Piece], level: bool | str,
                inside: tuple[int, ...], *, run: bool = False) -> ir.StageAD | None:
        """The stage's autodiff on the joint stitched from `pieces` (bounds `inside`, relative to the stage's
        start), None where the stage's joint is not its pieces' (`stitch.NotStitchable`) or, to `run` it, where
        it does not run on the stage's strides (`stitch.check_runs`: costing needs no run)."""
        constant, aux = stage_constants(stage)
        diff_in, diff_out = diff_positions(stage.graph, constant, aux)
        key = joint_key(stage.graph, diff_in, diff_out, self.device)
        found = self._stitched.get((key, inside))
        if found is None:
            joint, why = self._stitched_joint(stage, pieces, diff_in, diff_out)
            found = Stitched(joint)
            if why is None:
                self._stitched[(key, inside)] = found
            else:  # a piece's trace raised: maybe not for good (an interrupt, a setting outside the key)
                self._stitched.keep((key, inside), found)
        if found.joint is not None and run and found.runs is None:
            found = self._stitched[(key, inside)] = attrs.evolve(found, runs=_runs(found.joint, self.device))
        joint = found.joint if found.runs or not run else None
        return None if joint is None else autodiff(stage, level, device=self.device, joints={key: joint})

    def _stitched_joint(self, stage: ir.Stage, pieces: Sequence[stitch.Piece], diff_in: Sequence[int],
                        diff_out: Sequence[int]) -> tuple[ir.Graph | None, Exception | None]:
        """The stage's joint stitched from its pieces', or None with the exception a piece's trace raised (None
        alone where the stage's joint is not its pieces': `stitch.NotStitchable`, the key's for good)."""
        try:
            joints = [stitch.piece_joint(p, self.device, self._joints) for p in pieces]
            return stitch.stitched_joint(stage, pieces, joints, diff_in, diff_out), None
        except stitch.NotStitchable:
            return None, None
        except Exception as why:  # noqa: BLE001 -- a piece's trace an op refuses: the stage's own trace decides
            log.info("a stage's joint is traced whole: a piece of it failed to trace (%s)", str(why)[:300])
            return None, why

    def stages(self, size: int, cuts: Sequence[int], recompute: Sequence[bool | str] = (),
               remat: Sequence[bool] = ()) -> tuple[StageInfo, ...]:
        """Every stage of `graph(size)` cut before the equations `cuts`, with the programs it runs (`running`;
        stage k at recompute level `recompute[k]`, or "cheap" where `remat[k]`: a Plan's two flags)."""
        return tuple(StageInfo(st, self.running(size, st, level_at(recompute, st.index, remat), cuts))
                     for st in ir.split(self.graph(size), cuts))


def _runs(joint: ir.Graph, device: str) -> bool:
    try:
        stitch.check_runs(joint, device)
    except stitch.NotStitchable as why:
        log.info("a stage's stitched joint is traced instead: %s", str(why)[:300])
        return False
    return True


def level_at(recompute: Sequence[bool | str], k: int, remat: Sequence[bool] = ()) -> bool | str:
    """Stage k's recompute level from per-stage levels (or a Plan's flags: `recompute` full, `remat` cheap)."""
    level = recompute_level(recompute[k]) if k < len(recompute) else False
    return "cheap" if level is False and k < len(remat) and remat[k] else level


def stage_constants(stage: ir.Stage) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What a stage's autodiff holds constant: its batch leaves and the received values that carry no
    gradient (`frozen_in`: RoPE's tables, masks) among its inputs; among its outputs the sent values that
    carry none (`frozen_out`) and, on the last stage, the loss function's aux outputs."""
    n_params, n_batch = len(stage.param_ids), len(stage.batch_ids)
    aux = range(len(stage.acts_out) + 1, len(stage.graph.outputs)) if stage.is_last else range(0)
    inputs = (*range(n_params, n_params + n_batch), *(n_params + n_batch + k for k in stage.frozen_in))
    return inputs, (*stage.frozen_out, *aux)


def autodiff(stage: ir.Stage, recompute: bool | str = False, *, device: str | None = None,
             joints: dict[Any, ir.Graph] | None = None) -> ir.StageAD:
    """`ir.stage_autodiff` of a stage, its params differentiated, its batch leaves and (last stage) the loss
    function's aux outputs constant (`device`: where the programs will run; None, the graph's own)."""
    constant, aux = stage_constants(stage)
    return ir.stage_autodiff(stage.graph, constant=constant, constant_outputs=aux,
                             device=device, recompute=recompute, joints=joints)


def stage_programs(graph: ir.Graph, cuts: Sequence[int], recompute: Sequence[bool | str] = (), *,
                   device: str | None = None, remat: Sequence[bool] = ()) -> tuple[StageInfo, ...]:
    """Every stage of a graph one traced by hand, with its programs, nothing kept (tests, tools)."""
    return tuple(StageInfo(st, autodiff(st, level_at(recompute, st.index, remat), device=device))
                 for st in ir.split(graph, cuts))


@attrs.frozen(eq=False)
class Planned:
    """A Plan with what was computed to make it: the microbatch graph, every stage's F/B/W programs, and
    the schedule table lowered (sends and receives placed) and validated. Every rank builds the same."""

    plan: Plan
    graph: ir.Graph
    _stages: tuple[StageInfo, ...] | Callable[[], tuple[StageInfo, ...]]  # or how to build them, on first use
    table: schedules.Table
    finish: Callable[[Any, int], Any] | None = None  # a deferred aux's second half (ir.deferred), run by the Step
    _built: dict[str, tuple[StageInfo, ...]] = attrs.field(factory=dict, init=False, repr=False)

    @property
    def stages(self) -> tuple[StageInfo, ...]:
        """Every stage with its F/B/W programs. The planner costs stages on stitched joints (`Workshop.costing`)
        and hands these over unbuilt: each stage's joint is traced here, when a Step or a tool first asks,
        so `engine.plan` (the Plan alone) never traces one."""
        if "stages" not in self._built:
            self._built["stages"] = self._stages() if callable(self._stages) else self._stages
        return self._built["stages"]

    @property
    def num_params(self) -> int:
        return self.graph.num_params


def lowered_table(plan: Plan, build: Callable[..., schedules.Table] | None = None, *,
                  trust_lowered: bool = False) -> schedules.Table:
    """The plan's table with its communication placed (a user's table may come lowered by hand), validated:
    a deadlock or a missing action is refused here, on every rank alike, before any program is emitted.
    `trust_lowered` skips the check for a table that came lowered (the harness runs such a table as
    written, to show what the runtime does with it)."""
    table = build_table(build or schedules.get(plan.schedule), plan.schedule, plan.num_stages, plan.microbatches,
                        dict(plan.schedule_options))
    if table.is_lowered and trust_lowered:
        return table
    if not table.is_lowered:
        table = schedules.lower(table)
    schedules.validate(table)
    return table


class IncompleteTableError(schedules.ScheduleError):
    """A schedule's builder made a table for other stage or microbatch counts than it was asked for."""


def build_table(build: Callable[..., schedules.Table], name: str, num_stages: int, microbatches: int,
                options: dict[str, Any]) -> schedules.Table:
    """`build(num_stages, microbatches, **options)`, refused unless the table is for exactly that many stages
    and microbatches (`schedules.validate` then checks that each appears once, in dependency order): a
    table that leaves out a microbatch would train on part of the batch and return wrong grads."""
    table = build(num_stages, microbatches, **options)
    if not isinstance(table, schedules.Table):
        raise IncompleteTableError(f"schedule '{name}' returned {type(table).__name__}, not a schedules.Table; "
                                      "a schedule is (num_stages, num_microbatches, **options) -> Table")
    if (table.num_stages, table.num_microbatches) != (num_stages, microbatches):
        raise IncompleteTableError(
            f"schedule '{name}' was asked for {num_stages} stages x {microbatches} microbatches and built a table "
            f"of {table.num_stages} stages x {table.num_microbatches} microbatches; every stage must run F and "
            f"its backward for every microbatch (0..{microbatches - 1}) exactly once: fix the schedule's builder")
    return table


def planned_from(plan: Plan, workshop: Workshop, *, table: schedules.Table | None = None) -> Planned:
    """Attach the artefacts to a Plan made elsewhere (a plan cache hit, a hand-made or harness plan):
    its graph and stage programs from `workshop` (built there only if not built before)."""
    size = plan.microbatch_size or _size_of(workshop.batch, plan.microbatches * plan.dp)
    check_plan(workshop, plan, size)  # a loss that compares rows, cut by a cached or hand-made plan
    graph = workshop.graph(size)
    if plan.num_eqns and plan.num_eqns != len(graph.eqns):
        raise PlanError(f"the plan was made for a graph of {plan.num_eqns} equations, this model traces to "
                        f"{len(graph.eqns)} at microbatch size {size}; plan again for this model")
    stages = workshop.stages(size, plan.cuts, plan.recompute, plan.remat)
    return Planned(plan, graph, stages, table if table is not None else lowered_table(plan), workshop.finish)


def microbatch_spec(x: Any, size: int) -> ir.TensorSpec:
    """A batch leaf's spec with `size` rows."""
    if isinstance(x, ir.TensorSpec):
        return ir.TensorSpec((size, *x.shape[1:]), x.dtype, x.device)
    device = None if x.device.type == "meta" else str(x.device)
    return ir.TensorSpec((size, *x.shape[1:]), x.dtype, device)


def _size_of(batch: Sequence[Any], parts: int) -> int:
    leaves = pytree.tree_leaves(tuple(batch))
    rows = int(leaves[0].shape[0]) if leaves and isinstance(leaves[0], (torch.Tensor, ir.TensorSpec)) else 0
    if not rows or rows % parts:
        raise PlanError(f"the batch has {rows} rows, which do not split into {parts} equal microbatches "
                        "(microbatches x dp); pick a batch size that is a multiple of it")
    return rows // parts
