"""`assert_parallel_equivalent`: the pipelined step of a model computes what `torch.func.grad` computes.

In one process (the default) every rank's program runs in a thread of this process over an
in-process hub with rendezvous semantics (`engine.inprocess`), so a program that deadlocks is
reported (`ParallelDeadlock`) instead of hanging, and the full grad tree is compared. Under mpirun or
torchrun (torch.distributed initialised, or a launcher's WORLD_SIZE > 1) the real runtime runs through
`engine.parallelize` and each rank compares the leaves it holds; every rank then raises if any did.

    from hypothesis import given
    from engine.testing import assert_parallel_equivalent, plans

    @given(plans(batch_size=16))
    def test_my_model(spec):
        assert_parallel_equivalent(loss_fn, params, x, y, plan=spec)

A function with state (`engine.functionalize` of a module with BatchNorm in train mode, any `ir.deferred`
function) is checked against its microbatched reference instead (`engine.testing.stateful`): loss and grads
averaged over the plan's microbatches x dp, and every rank's returned state against the full-step update.

Tolerances are per dtype (see `engine.testing.mismatch`). A failure raises `ParallelMismatch` (an
AssertionError) reporting the first differing leaf by key path with its errors and values, the model
description, the plan, the schedule and every rank's program listing.
"""
from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

import ir
import schedules
from ir.token_mean import token_mean

from ..errors import CommTimeoutError
from ..execution.executor import Hook
from ..execution.inprocess import run_steps, steps_of
from ..execution.loss_weights import loss_weights
from ..execution.step import Step
from ..execution.transport import DeadlockError
from ..planning.artifacts import lowered_table, planned_from
from ..planning.candidates import MULTI_STAGE_SCHEDULES
from ..planning.plan import Plan
from . import stateful
from ._cache import graph_of, workshop_of
from .mismatch import (
    LeafDiff,
    ParallelDeadlock,
    ParallelMismatch,
    compare_leaves,
    format_failure,
    headline,
)
from .models import ModelCase
from .plans import PlanSpec

__all__ = ["STATS", "Checked", "Equivalence", "assert_parallel_equivalent", "format_stats", "in_distributed_job",
           "reference_grad_and_value"]


@attrs.frozen
class Checked:
    """What `STATS` counts equivalence checks by."""

    schedule: str
    world_size: int
    dp: int
    dtype: str


STATS: collections.Counter[Checked] = collections.Counter()


@attrs.frozen
class Equivalence:
    """A passed check: the plan it ran, both losses and the worst relative error over loss and grads."""

    plan: Plan
    loss: float
    expected_loss: float
    max_rel_error: float
    worst: str
    leaves: int
    distributed: bool


def format_stats(stats: collections.Counter[Checked] | None = None) -> str:
    """One line per schedule: checks run, by world size and dp."""
    stats = STATS if stats is None else stats
    by: dict[str, collections.Counter[str]] = {}
    for key, n in stats.items():
        by.setdefault(key.schedule, collections.Counter())[f"w{key.world_size}/dp{key.dp}/{key.dtype}"] += n
    lines = [f"fnpipe equivalence checks: {sum(stats.values())}"]
    for name in sorted(by):
        layouts = ", ".join(f"{k} {v}" for k, v in sorted(by[name].items()))
        lines.append(f"  {name}: {sum(by[name].values())} ({layouts})")
    return "\n".join(lines)


def in_distributed_job() -> bool:
    """True under mpirun/torchrun with more than one rank (or an initialised multi-rank process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return any(int(os.environ.get(v, "1")) > 1 for v in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))


@contextlib.contextmanager
def _one_thread_per_rank() -> Iterator[None]:
    """The ranks are threads already; OpenMP's own threads on top spin against them (on a busy machine a
    layer norm of a few elements took 8 ms instead of 5 us), so ops run single-threaded during the check."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- one process


def inprocess_steps(fn: Callable, params: Any, batch: Sequence[Any], plan: Plan, *, hook: Hook | None = None,
                    timeout: float = 60.0) -> tuple[Step, ...]:
    """`engine.execution.inprocess.build_steps` with the model's Workshop kept across calls (each microbatch
    size traced once, each stage differentiated once). A schedule whose table is already lowered (it holds
    SEND/RECV actions) is emitted as written, without `schedules.validate`, so the runtime itself shows
    what such a table does (a deadlock, say)."""
    planned = planned_from(plan, workshop_of(fn, params, batch), table=lowered_table(plan, trust_lowered=True))
    return steps_of(planned, timeout=timeout, hook=hook)


def _diagnose(table: schedules.Table) -> str:
    """What `schedules.validate` says about a table whose programs could not finish."""
    try:
        schedules.validate(table)
    except schedules.ScheduleError as err:
        return f"\nschedules.validate on the lowered table: {err}"
    return ""


# ---------------------------------------------------------------- the check


def _spec(schedule: str, stages: int | None, microbatches: int | None, dp: int | None, stages_per_rank: int | None,
          cuts: Sequence[int] | None, batch: Sequence[Any], world: int | None) -> PlanSpec:
    """A PlanSpec from the keyword form; in one process `stages` defaults to a pipeline depth of 2."""
    v = stages_per_rank or (2 if schedule in MULTI_STAGE_SCHEDULES else 1)
    dp = dp or 1
    stages = stages or (len(cuts) + 1 if cuts is not None else v * (world // dp if world else 2))
    if microbatches is None:
        microbatches = _default_microbatches(schedule, stages, v, dp, batch)
    return PlanSpec(schedule, stages, microbatches, dp, v, cuts=cuts)


def _default_microbatches(schedule: str, stages: int, v: int, dp: int, batch: Sequence[Any]) -> int:
    """The count nearest 2 x depth that divides the batch and that the schedule accepts."""
    size = int(pytree.tree_leaves(tuple(batch))[0].shape[0]) // dp
    p, fn = max(1, stages // v), schedules.get(schedule)
    key = MULTI_STAGE_SCHEDULES.get(schedule)
    for m in sorted((d for d in range(1, size + 1) if size % d == 0), key=lambda d: (d < p, abs(d - 2 * p))):
        try:
            fn(stages, m, **({key: v} if key else {}))
            return m
        except schedules.ScheduleError:
            continue
    return 1


def _unpack(fn: Any, params: Any, batch: tuple[Any, ...], description: str | None) -> tuple[Any, ...]:
    if isinstance(fn, ModelCase):
        if params is not None or batch:
            raise TypeError("pass a ModelCase alone (its params and batch are used), or fn, params, *batch")
        return fn.fn, fn.params, fn.batch, description or fn.description
    return fn, params, batch, description


def assert_parallel_equivalent(fn: Callable | ModelCase, params: Any = None, *batch: Any,
                               plan: PlanSpec | Plan | None = None, schedule: str = "1f1b", stages: int | None = None,
                               microbatches: int | None = None, dp: int | None = None,
                               stages_per_rank: int | None = None, cuts: Sequence[int] | None = None,
                               rtol: float | None = None, atol: float | None = None, hook: Hook | None = None,
                               timeout: float = 60.0, distributed: bool | None = None,
                               description: str | None = None) -> Equivalence:
    """Run `fn(params, *batch)` (a scalar loss, a mean over the batch) as a pipeline and check that its loss
    and every grad leaf equal `torch.func.grad_and_value(fn)(params, *batch)` on the full batch.

    The layout is `plan` (a `PlanSpec`, e.g. drawn by `plans()`, or an `engine.Plan`) or the keywords. In
    one process `stages` defaults to 2 ranks' worth, `dp` to 1 and `microbatches` to about twice the pipeline
    depth; under a launcher the job's world is used and unset keywords go to the planner. `fn` may be a
    `ModelCase` (then pass nothing else positionally; its description goes in failure reports). `rtol`/`atol`
    default per dtype (see `engine.testing.mismatch`). `hook(executor, instr)` runs before every instruction
    (fault injection, see `engine.testing.faults`). Returns an `Equivalence`; raises `ParallelMismatch`.
    """
    fn, params, batch, description = _unpack(fn, params, batch, description)
    if distributed is None:
        distributed = in_distributed_job()
    if isinstance(plan, Plan) and not distributed:  # a hand-made Plan runs as it is
        spec, fixed = None, plan
    else:
        spec, fixed = _as_spec(plan, schedule, stages, microbatches, dp, stages_per_rank, cuts, batch, distributed,
                               timeout), None
    with contextlib.nullcontext() if distributed else _one_thread_per_rank():
        state_ref = None
        if ir.deferred_of(fn) is not None:  # BatchNorm in train mode: the microbatched reference, and its state
            layout = fixed or spec
            parts = layout.microbatches * layout.dp
            weights = loss_weights(token_mean(graph_of(fn, params, batch, parts)), stateful.chunks(batch, parts))
            loss_ref, grads_ref, state_ref = stateful.reference(fn, params, batch, parts, weights)
        else:
            grads_ref, loss_ref = reference_grad_and_value(fn, params, batch)
        check = _Check(fn, params, batch, spec, description, rtol, atol, loss_ref, grads_ref, state_ref)
        if distributed:
            return check.distributed(hook, timeout)
        return check.inprocess(fixed or spec.to_plan(fn, params, *batch), hook, timeout)  # type: ignore[union-attr]


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def reference_grad_and_value(fn: Callable, params: Any, batch: Sequence[Any]) -> tuple[Any, torch.Tensor]:
    """`torch.func.grad_and_value(fn)(params, *batch)` over the floating leaves of params only: integer and
    bool leaves (position ids, masks, integer buffers) cannot require grad, and their grads are None, as the
    pipelined step returns them."""
    leaves, tree = pytree.tree_flatten(params)
    diff = [i for i, x in enumerate(leaves) if _differentiable(x)]

    def of_floats(floats: list[torch.Tensor]) -> torch.Tensor:
        full = list(leaves)
        for i, x in zip(diff, floats):
            full[i] = x
        return fn(pytree.tree_unflatten(full, tree), *batch)

    try:
        grads, loss = torch.func.grad_and_value(of_floats)([leaves[i] for i in diff])
    except RuntimeError as exc:  # an autograd.Function torch.func cannot transform (BLOOM's GeLUFunction
        if "setup_context" not in str(exc):  # has no setup_context): the same numbers through torch.autograd
            raise
        grads, loss = _autograd_grad_and_value(of_floats, [leaves[i] for i in diff])
    out: list[Any] = [None] * len(leaves)
    for i, g in zip(diff, grads):
        out[i] = g
    return pytree.tree_unflatten(out, tree), loss


def _not_a_mean(loss: LeafDiff) -> str:
    """A loss far off is most often a function that is not a mean over the batch's rows: say so."""
    if loss.ok or loss.rel < 1e-3:
        return ""
    return ("\n\nnote: the pipeline's loss is the mean of its microbatches' losses, which is the batch's only when the "
            "loss is a mean of per-row terms. A loss that compares rows with each other (a contrastive loss such as "
            "CLIP's, batch statistics, a router's load-balancing loss) is not: run it with microbatches=1 and dp=1")


def _autograd_grad_and_value(f: Callable, floats: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`torch.func.grad_and_value(f)(floats)` by `torch.autograd.grad` on detached copies (zeros for leaves the
    loss does not reach, as torch.func gives)."""
    xs = [x.detach().requires_grad_(True) for x in floats]
    with torch.enable_grad():
        loss = f(xs)
        got = torch.autograd.grad(loss, xs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(xs, got)], loss.detach()


def _as_spec(plan: PlanSpec | Plan | None, schedule: str, stages: int | None, microbatches: int | None,
             dp: int | None, stages_per_rank: int | None, cuts: Sequence[int] | None, batch: Sequence[Any],
             distributed: bool, timeout: float) -> PlanSpec:
    from ..execution import launch

    world = launch.init(timeout).size if distributed else None
    if isinstance(plan, Plan):
        spec = PlanSpec(plan.schedule, plan.num_stages, plan.microbatches, plan.dp,
                        plan.num_stages // plan.pipeline_depth, cuts=plan.cuts,
                        replicas=plan.replicas if any(c > 1 for c in plan.replicas) else None,
                        replica_order=plan.replica_order)
    else:
        spec = plan or _spec(schedule, stages, microbatches, dp, stages_per_rank, cuts, batch, world)
    if world is not None and spec.world_size != world:
        raise ValueError(f"{spec} needs {spec.world_size} ranks but the job has {world}; draw plans() with "
                         f"world_sizes=({world},) (the default under a launcher)")
    return spec


@attrs.define
class _Check:
    fn: Callable
    params: Any
    batch: tuple[Any, ...]
    spec: PlanSpec | None
    description: str | None
    rtol: float | None
    atol: float | None
    loss_ref: torch.Tensor
    grads_ref: Any
    state_ref: Any = None  # a deferred function's expected state (engine.testing.stateful)

    def names(self) -> list[str]:
        from ir.trace import key_name

        return [key_name(p) or "params" for p, _ in pytree.tree_flatten_with_path(self.params)[0]]

    def report(self, what: str, plan: Plan | None, programs: Sequence[Any], loss: LeafDiff | None = None,
               grads: Sequence[LeafDiff] = ()) -> str:
        return format_failure(what, description=self.description, spec=self.spec, plan=plan, programs=programs,
                              loss=loss, grads=grads)

    def inprocess(self, plan: Plan, hook: Hook | None, timeout: float) -> Equivalence:
        steps = inprocess_steps(self.fn, self.params, self.batch, plan, hook=hook, timeout=timeout)
        programs = steps[0].programs
        try:
            result = run_steps(steps, self.params, self.batch)
        except (DeadlockError, CommTimeoutError) as exc:
            headline = f"the ranks' programs cannot finish: {exc}{_diagnose(steps[0].table)}"
            raise ParallelDeadlock(self.report(headline, plan, programs)) from exc
        except Exception as exc:
            raise ParallelMismatch(self.report(f"the parallel run failed: {type(exc).__name__}: {exc}", plan,
                                               programs)) from exc
        actual = pytree.tree_leaves(result.grads, is_leaf=lambda x: x is None)
        loss, states = result.loss, [aux for (_, aux), _ in result.per_rank] if self.state_ref is not None else []
        return self.verdict(plan, programs, loss[0] if states else loss, actual, distributed=False, states=states)

    def verdict(self, plan: Plan, programs: Sequence[Any], loss: torch.Tensor, actual: Sequence[Any], *,
                distributed: bool, skip: Sequence[bool] = (), states: Sequence[Any] = ()) -> Equivalence:
        names, expected = self.names(), pytree.tree_leaves(self.grads_ref, is_leaf=lambda x: x is None)
        keep = [i for i in range(len(expected)) if not (skip and skip[i]) and expected[i] is not None]
        loss_diff = compare_leaves(["loss"], [loss], [self.loss_ref], rtol=self.rtol, atol=self.atol)[0]
        grads = compare_leaves([names[i] for i in keep], [actual[i] for i in keep], [expected[i] for i in keep],
                               rtol=self.rtol, atol=self.atol) + self.state_diffs(states)
        STATS[Checked(plan.schedule, plan.world_size, plan.dp, str(self.loss_ref.dtype).replace("torch.", ""))] += 1
        what = headline(loss_diff, grads)
        message = (self.report(what, plan, programs, loss_diff, grads) + self.precision_hint() + _not_a_mean(loss_diff)
                   if what else None)
        if distributed:
            message = _gather_failure(message)
        if message:
            raise ParallelMismatch(message)
        worst = max([loss_diff, *grads], key=lambda d: d.rel)
        return Equivalence(plan, float(loss), float(self.loss_ref), worst.rel, worst.name, len(grads), distributed)

    def precision_hint(self) -> str:
        """When the function computes in a dtype coarser than its loss (a float64 model whose norms upcast to
        float32, as Gemma's do), the rounding of those ops, not the pipeline, may be what differs: say so."""
        ref = min([self.loss_ref.dtype, *(g.dtype for g in pytree.tree_leaves(self.grads_ref) if g is not None)],
                  key=lambda d: torch.finfo(d).eps)  # the finest dtype compared: a float32 loss, float64 grads
        try:
            g = graph_of(self.fn, self.params, self.batch)
        except Exception:  # noqa: BLE001 -- only a hint
            return ""
        found = [(e.op.removeprefix("aten.").split(".")[0], v.aval.dtype) for e in g.eqns for v in e.out_vars
                 if v.aval.dtype.is_floating_point and torch.finfo(v.aval.dtype).eps > torch.finfo(ref).eps]
        if not found:
            return ""
        coarse = collections.Counter(op for op, _ in found)
        dtypes = sorted({str(d).replace("torch.", "") for _, d in found})
        ops = ", ".join(f"{op} x{n}" for op, n in coarse.most_common(4))
        worst = max(torch.finfo(d).eps for _, d in found)
        finest = str(ref).replace("torch.", "")
        return (f"\n\nnote: the function computes {len(found)} values in {'/'.join(dtypes)} ({ops}) although "
                f"its loss or grads are {finest}: their rounding ({worst:.0e} relative) is above rtol, and microbatches "
                f"round differently from the full batch. If the model casts on purpose, pass "
                f"rtol={max(1e-6, 10 * worst):.0e} (or run it in one dtype)")

    def state_diffs(self, states: Sequence[Any]) -> list[LeafDiff]:
        """Every rank's returned state (it gets all of it) against the reference state, leaf by leaf."""
        if self.state_ref is None:
            return []
        paths, expected = zip(*pytree.tree_flatten_with_path(self.state_ref)[0])
        names = [f"rank {r} state{pytree.keystr(p)}" for r in range(len(states)) for p in paths]
        got = [x for state in states for x in pytree.tree_leaves(state)]
        return compare_leaves(names, got, list(expected) * len(states), rtol=self.rtol, atol=self.atol)

    def distributed(self, hook: Hook | None, timeout: float) -> Equivalence:
        import engine

        spec = self.spec
        assert spec is not None
        cuts = None
        if spec.cuts is not None or spec.weights is not None:
            graph = graph_of(self.fn, self.params, self.batch, spec.microbatches * spec.dp)
            cuts = spec.resolve_cuts(len(graph.eqns))
        step = engine.parallelize(self.fn, self.params, *self.batch, schedule=spec.schedule,
                                  microbatches=spec.microbatches, stages=spec.stages, dp=spec.dp,
                                  stages_per_rank=spec.stages_per_rank, cuts=cuts, timeout=timeout, hook=hook,
                                  has_aux=self.state_ref is not None, min_microbatch_size=1,
                                  replicas=spec.replicas,
                                  compiler="fx")  # the pipeline is under test, not inductor: no compile per case
        try:
            loss, grads = step(step.shard(self.params), *self.batch)
            loss, states = (loss[0], [loss[1]]) if self.state_ref is not None else (loss, [])
        except Exception as exc:
            raise ParallelMismatch(self.report(f"rank {step.world.rank}: the parallel run failed: "
                                               f"{type(exc).__name__}: {exc}", step.plan, step.programs)) from exc
        actual = pytree.tree_leaves(grads, is_leaf=lambda x: x is None)
        skip = [pid not in step.local_params for pid in range(len(actual))]
        return self.verdict(step.plan, step.programs, loss.cpu(), actual, distributed=True, skip=skip, states=states)


def _gather_failure(message: str | None) -> str | None:
    """Every rank learns every rank's verdict, so all raise together (hypothesis then shrinks in step)."""
    from ..execution.transport import gather_json

    verdicts = gather_json(message)
    failed = [(r, m) for r, m in enumerate(verdicts) if m]
    if not failed:
        return None
    r, first = failed[0]
    return f"rank {r} (of ranks {[x for x, _ in failed]} that differ) reports: {first}"
