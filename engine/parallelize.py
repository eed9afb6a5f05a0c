"""`engine.parallelize`: a pure loss function becomes a pipelined `step(params, *batch) -> (loss, grads)`.

The one public entry, straight through: trace -> plan (engine.planning) -> stage programs and this
rank's program (engine.execution) -> fingerprint check -> Step.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

import ir

from .errors import PlanError, RuntimeMismatchError, require_function
from .execution import launch
from .execution import rebalance as rebalancing
from .execution.compilers import resolve, use_cache_dir
from .execution.graphs import enabled as graphs_enabled
from .execution.post_cost import faster_posts
from .execution.profile import faster_of
from .execution.executor import COMPILERS, Hook, check_compiler
from .execution.inputs import check_mode
from .execution.step import Step, connect, microbatch_example
from .execution.transport import compile_wait
from .planning import cache as plancache
from .planning.artifacts import Planned, Workshop, lowered_table, planned_from
from .planning.calibration import Calibration
from .planning.candidates import batch_size_of
from .planning.recipe import Recipe, recipe_of
from .planning.replicas import requested as requested_replicas
from .planning.search import schedule_builder, search
from .setup_clock import SetupClock
from .training.precision import mixed_precision

log = logging.getLogger("engine.runtime")


def calibration(world: launch.World, workshop: Workshop, where: bool | str | os.PathLike, *, microbatches: Any,
                dp: Any, compiler: str = "fx", timeout: float = 60.0) -> Any:
    """Rank 0 times the model's ops on its device, all ranks get the table. A table saved at `where` is
    loaded first and only the signatures it lacks are timed (another microbatch size or dp makes new
    shapes); the grown table is saved back. With `compiler` other than fx (as resolved for the device),
    the model's programs compiled by it are timed too (`Calibration.compiled`). The others wait for rank 0
    as for a compile (FNPIPE_COMPILE_WAIT, not `timeout`: a wide ResNet's ops take minutes to time). If
    rank 0 fails, every rank raises with its error."""
    table, error = None, None
    if world.rank == 0:
        try:
            table = _calibrate_here(world, workshop, where, microbatches, dp, compiler)
        except Exception as exc:  # noqa: BLE001 -- re-raised below, after the others have heard of it
            error = exc
    if world.distributed:  # always: rank 0's table wins, whatever each rank found on disk
        from .execution.transport import broadcast_after_local_work
        from .planning.calibration import Calibration

        text, message = broadcast_after_local_work(
            [None if table is None else table.to_json(), None if error is None else f"{type(error).__name__}: {error}"],
            timeout, "calibrating the model's ops")
        table = None if text is None else Calibration.from_json(text)
        if message is not None and error is None:
            raise PlanError(f"calibration failed on rank 0 ({message}); fix that run, or pass calibrate=False")
    if error is not None:
        raise error
    return table


def _calibrate_here(world: launch.World, workshop: Workshop, where: bool | str | os.PathLike, microbatches: Any,
                    dp: Any, compiler: str = "fx") -> Any:
    from .planning.calibration import Calibration, calibrate_training
    from .planning.regions import with_regions

    path = None if where is True else os.fspath(where)
    known = Calibration.load(path) if path is not None and os.path.exists(path) else None
    parts = (microbatches if isinstance(microbatches, int) else world.size) * (dp if isinstance(dp, int) else 1)
    example = microbatch_example(workshop.batch, parts)
    graph = workshop.graph(batch_size_of(workshop.batch) // parts)
    real = pytree.tree_leaves((workshop.params, example))
    inputs = real if all(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in real) else None
    others = {} if compiler == "fx" else {compiler: COMPILERS[compiler]}
    table = calibrate_training(graph, world.device, calibration=known, inputs=inputs,
                               compile_program=COMPILERS["fx"], compiled=others)
    if inputs is not None:  # the scales of spans of the model, for the compiler the plan is for
        table = with_regions(graph, world.device, table, inputs, {compiler: COMPILERS[compiler]}, known)
    if path is not None and table != known:
        table.save(path)
    return table


def parallelize(loss_fn: Callable, params: Any, *example_batch: Any, schedule: str = "auto",
                microbatches: int | str = 8, stages: int | str | None = None, dp: int | str | None = None,
                memory_limit: int | None = None, stages_per_rank: int | None = None,
                cuts: Sequence[int] | None = None, timeout: float = 60.0, hook: Hook | None = None,
                plan_cache: str | os.PathLike | None = None,
                calibrate: bool | str | os.PathLike = False, recompute: bool | str = "auto",
                compute_dtype: torch.dtype | None = None, compiler: str = "auto", has_aux: bool = False,
                check_inputs: str = "first", shard_optimizer: bool | str = False, recipe: Recipe | None = None,
                min_microbatch_size: int | None = None, replicas: Sequence[int] | str | None = None,
                rebalance: bool | str = "auto") -> Step:
    """Trace, plan, emit and check the pipelined step of `loss_fn` for this job (see README).

    For a loss that is a mean over the batch, `step(params, *batch)` returns the full-batch loss on
    every rank and grads equal to `torch.func.grad(loss_fn)(params, *batch)` on the leaves this rank
    holds (None elsewhere), for every schedule, stage count, microbatch count and dp degree. `loss_fn`
    returns one floating-point scalar that depends on the params (else ir.TraceError, here), or with
    `has_aux=True` a pair `(loss, aux)`: the step then returns `((loss, aux), grads)`, each aux leaf averaged
    over the microbatches like the loss and given to every rank (README, "The contract"). Each call checks
    this rank's params and batch against the plan (engine.InputError); `check_inputs` ("first", "every",
    "never") is when the ranks also compare fingerprints of their batch and params. `schedule` is a
    registered name (`schedules.names()`) or "auto" (the default): every built-in planned with the model's
    costs, the fastest predicted kept (`step.plan.considered` lists them; one rank runs the one schedule). `min_microbatch_size`
    (rows) is the smallest microbatch the planner may make (PlanError if the counts given force smaller);
    None: 16 for BatchNorm in train mode (engine/training/batchnorm.py), 1 otherwise.
    `plan_cache` (a directory, or a .json deployment file) reuses a plan made for the same model,
    world, schedule and options instead of planning again (engine.planning.cache). `calibrate=True` times
    every op of the model once on rank 0's device before splitting, so the split balances measured
    rather than roofline costs; a path reuses (or writes) that table, so reruns and plan caches agree.
    `recompute` is activation recomputation: False, True (every stage) or "auto" (only the stages that
    do not fit memory without it; `step.plan.recompute` says which). `compute_dtype` (e.g.
    torch.bfloat16) runs the model with its float params cast to that dtype inside the graph while
    params and grads keep theirs (engine.precision.mixed_precision; grads are then those of that function).
    `compiler` runs each stage program as generated fx Python ("fx": eager's kernels, no compile time),
    compiled by torch.compile's inductor ("inductor": fused kernels, a compile per distinct stage program,
    paid here, kept on disk for the next run), or "auto" (the default): inductor on CUDA, fx elsewhere
    (engine.execution.compilers; `step.compile_seconds` says what each stage's compile took). `replicas` is how many ranks
    run each pipeline stage, like (2, 1): stage 0 on two ranks, each running every other microbatch, stage 1 on
    one (world = sum x dp); "auto" (the default when stages or dp is "auto") lets the planner choose unequal
    counts where it predicts a faster step (engine.planning.replicas). `rebalance`: once the stage programs are
    measured (on CUDA, before the first step), re-split the same layout with each stage's measured / planned
    seconds in the cost model (refitted per kind of block, engine.planning.tied) and rebuild the step on the new
    cuts where that is predicted 1 % faster than the running cuts costed alike (engine.execution.rebalance;
    `step.rebalanced` says what moved); "auto" (the default) where programs are
    measured, True also on CPU (it measures them there), False never; "step" takes each stage's seconds from
    traced steps on the example batch instead (what its programs take beside the others' work and the
    transfers) and keeps the new split only if its own traced steps run faster. `timeout` (positive seconds) bounds every
    wait; the step holds
    process groups until `step.close()` (or the end of `with engine.parallelize(...) as step:`).
    `shard_optimizer` (ZeRO-1: True, False, or "auto": where a layout fits only so) splits the optimizer
    state over each stage's dp replicas: the step's grads are then each replica's part, and
    `engine.optim.ShardedOptimizer(step, engine.optim.adamw, ...)` sums, clips and steps them
    (engine/training/zero.py). `recipe` (engine.Recipe) is the training the memory is planned for.
    """
    require_function(loss_fn, "engine.parallelize")
    if compute_dtype is not None:
        loss_fn = _mixed(loss_fn, compute_dtype)
    _check_options(compiler, check_inputs, rebalance)
    replicas = requested_replicas(replicas)  # before any communication: every rank refuses a bad count alike
    build = schedule_builder(schedule)
    recipe = training_recipe(recipe, shard_optimizer)
    clock = SetupClock()
    with clock.phase("launch"):
        world = launch.init(timeout)
    workshop = Workshop(loss_fn, params, example_batch, device=world.device.type, has_aux=has_aux)
    compiler = resolve(compiler, world.device)  # "auto": inductor on CUDA, fx elsewhere
    options = dict(stages=stages, dp=dp, microbatches=microbatches, memory_limit=memory_limit,
                   device=world.device.type, stages_per_rank=stages_per_rank, cuts=cuts, recompute=recompute,
                   has_aux=has_aux, fused_recompute=compiler == "inductor", min_microbatch_size=min_microbatch_size,
                   **({"recipe": recipe} if recipe else {}), **({} if replicas is None else {"replicas": replicas}))
    planned = _planned(world, workshop, loss_fn, params, example_batch, schedule=schedule, build=build,
                       plan_cache=plan_cache, calibrate=calibrate, compiler=compiler, options=options, timeout=timeout,
                       clock=clock)
    use_cache_dir(plan_cache)  # inductor's compiled kernels beside the plans, unless TORCHINDUCTOR_CACHE_DIR says

    def started(found: Planned, entry: plancache.CachedPlan | None) -> Step:
        with clock.phase("differentiate"):  # the plan's stage programs, built on first use (a plan cache's: in plan)
            found.stages
        with clock.phase("connect"):
            transport = connect(world, found, timeout)
        with clock.phase("programs"):
            step = Step(found, world, transport, hook=hook, compiler=compiler, check_inputs=check_inputs, setup=clock)
        step.forward = getattr(loss_fn, "forward", None)  # engine.functionalize's eval-mode forward (step.evaluate)
        return _checked(step, entry, example_batch, measure=rebalance in (True, "step"))

    step = started(planned.planned, planned.entry)
    if rebalance is False or step.profile is None or cuts is not None:
        return _timed(step)

    def replan(*, measured: Any, cuts: Any = None) -> Planned:
        plan = step.plan
        same = dict(options, stages=plan.num_stages, dp=plan.dp, microbatches=plan.microbatches, cuts=cuts,
                    stages_per_rank=plan.num_stages // plan.pipeline_depth, measured=measured)
        same.pop("replicas", None)
        with clock.phase("re-split search"):
            return search(loss_fn, params, *example_batch, world_size=world.size, schedule=plan.schedule,
                          workshop=workshop, build=schedule_builder(plan.schedule), **same)

    def measure_again(s: Step) -> None:
        """`s`'s programs measured once more, each keeping the faster of its two times (a collective)."""
        once, posted = s.profile, s.posts
        s.profile_programs(*example_batch)
        s.profile = faster_of(once, s.profile)  # every rank merges the same two gathered profiles
        s.posts = faster_posts(posted, s.posts)

    if rebalance == "step":
        if not rebalancing.runnable(example_batch):
            log.warning("rank %d: rebalance=\"step\" runs steps on the example batch, which holds meta or fake "
                        "tensors; re-splitting from the measured programs instead", step.world.rank)
            return _timed(_rebalanced(step, replan, started, measure_again))
        return _timed(_rebalanced_in_steps(step, replan, started,
                                           lambda s: rebalancing.in_steps(s, params, example_batch)))
    return _timed(_rebalanced(step, replan, started, measure_again))


def _timed(step: Step) -> Step:
    """`step`, its setup's phases logged (engine.setup_clock)."""
    log.info("rank %d: %s", step.world.rank, step.setup)
    return step


def _rebalanced_in_steps(step: Step, replan: Callable[..., Planned], started: Callable[..., Step],
                         in_steps: Callable[[Step], tuple[Any, float]]) -> Step:
    """`parallelize(rebalance="step")`: `step`, or a Step rebuilt on the same layout re-split from what its
    programs take inside traced steps (`rebalance.in_steps`); the new split is kept only where its own traced
    steps run faster than the running step's (the faster of two traced steps each, no margin: the re-split was
    already predicted REBALANCE_GAIN faster), else the planner's cuts are started again (their compiles cached).
    Every rank decides from the same gathered spans; a rank whose re-split search fails tells the others
    (`_agreed`), but one that fails inside a step (out of memory, say) leaves them to the step's timeout."""
    try:
        profile, before = in_steps(step)
        found = _agreed(step, lambda: rebalancing.rebalance(step.planned, step.programs.all(), profile, replan))
    except BaseException:
        step.close()
        raise
    if found is None:
        log.info("rank %d: the programs inside steps propose no re-split; the planner's cuts stay", step.world.rank)
        return step
    step.close()
    rebuilt = started(found.planned, None)
    try:
        _, after = in_steps(rebuilt)
    except BaseException:
        rebuilt.close()
        raise
    rebuilt.rebalanced = attrs.evolve(found, stepped=(before, after))
    if after < before:
        log.info("rank %d: %s", rebuilt.world.rank, rebuilt.rebalanced)
        return rebuilt
    log.warning("rank %d: the re-split's traced steps took %.2f ms, the planner's cuts' %.2f ms: back to the "
                "planner's cuts", rebuilt.world.rank, after * 1e3, before * 1e3)
    rebuilt.close()
    return started(step.planned, None)


def _rebalanced(step: Step, replan: Callable[..., Planned], started: Callable[..., Step],
                measure_again: Callable[[Step], None]) -> Step:
    """`step`, or a Step rebuilt on the same layout re-split from its measured programs
    (engine.execution.rebalance). A re-split is made only from times seen twice: where the first measurement
    proposes one, the programs are measured again and the proposal made again from the faster of the two
    times of each program (`profile.faster_of`: a program timed slow once, by a hiccup of a shared device,
    moves nothing; one slow both times does). The ranks confirm they made the same
    choice before the old step closes; a re-split whose own measured programs predict a slower step than the
    planner's cuts goes back to them. A plan cache keeps the planner's plan: a re-split plan's stage times
    carry the measured scale it was made under, so measuring it against them would undo the re-split on the
    next launch; each launch re-splits from the planner's plan instead (the same cuts for the same
    measurements; its compiles cached). The new split's programs are measured as the running step's were
    (twice) before they are compared. A first measurement that hides an imbalance is not made again: only a
    proposal is checked, so a hiccup errs towards the planner's cuts. A rank that fails while re-splitting
    tells the others (`_agreed`), and the running step is closed before the error is raised."""
    def propose() -> rebalancing.Rebalanced | None:
        return rebalancing.rebalance(step.planned, step.programs.all(), step.profile, replan, posts=step.posts,
                                     replayed=step.replays_graphs)

    try:
        first = _agreed(step, propose)
        if first is None:
            return step
        measure_again(step)
        found = _agreed(step, propose)
    except BaseException:
        step.close()
        raise
    if found is None:
        log.info("rank %d: measured again, the programs propose no re-split (the first measurement alone proposed "
                 "cuts %s); the planner's cuts stay", step.world.rank, list(first.planned.plan.cuts))
        return step
    step.close()
    rebuilt = started(found.planned, None)
    measure_again(rebuilt)
    rebuilt.rebalanced = attrs.evolve(found, measured_after=rebuilt.predicted_step_time)
    log.info("rank %d: %s", rebuilt.world.rank, rebuilt.rebalanced)
    after = rebuilt.rebalanced.measured_after  # the same on every rank: from the gathered profile
    if after is None or after <= found.before:
        return rebuilt
    log.warning("rank %d: the re-split's measured programs predict %.2f ms, the planner's cuts' %.2f ms: back to "
                "the planner's cuts", rebuilt.world.rank, after * 1e3, found.before * 1e3)
    rebuilt.close()
    return started(step.planned, None)


def _agreed(step: Step, propose: Callable[[], rebalancing.Rebalanced | None]) -> rebalancing.Rebalanced | None:
    """What `propose()` found, once every rank is seen to have made the same choice (a collective). A rank whose
    proposal raised tells the others first: it raises its own error, every other rank RuntimeMismatchError
    naming it, rather than waiting out a timeout in the next collective."""
    error: BaseException | None = None
    try:
        found = propose()
    except Exception as exc:  # noqa: BLE001 -- every rank must hear of it before anyone raises
        found, error = None, exc
    mine = None if found is None else list(found.planned.plan.cuts)
    told = step.transport.all_gather_json([mine, None if error is None else f"{type(error).__name__}: {error}"])
    if error is not None:
        raise error
    failed = [(r, why) for r, (_, why) in enumerate(told) if why]
    if failed:
        raise RuntimeMismatchError(f"rank {failed[0][0]} failed while re-splitting from the measured programs "
                                   f"({failed[0][1]}); its log has the whole error; pass rebalance=False to keep "
                                   "the planner's cuts")
    chosen = [cuts for cuts, _ in told]
    if any(c != mine for c in chosen):
        raise RuntimeMismatchError(f"rank {step.world.rank}: the ranks re-split differently from the same measured "
                                   f"programs (cuts per rank: {chosen}); pass rebalance=False and report this")
    return found


def training_recipe(recipe: Recipe | None, shard_optimizer: bool | str) -> Recipe | None:
    """The recipe to plan for: the user's, or one that only says shard_optimizer (Adam in the params' dtype)."""
    recipe = recipe_of(recipe)
    if recipe is None:
        return Recipe(shard_optimizer=shard_optimizer) if shard_optimizer is not False else None
    if shard_optimizer is not False and shard_optimizer != recipe.shard_optimizer:
        raise PlanError(f"shard_optimizer={shard_optimizer!r} but recipe.shard_optimizer="
                        f"{recipe.shard_optimizer!r}; give it once, in the recipe")
    return recipe


def _mixed(fn: Callable, dtype: torch.dtype) -> Callable:
    """`mixed_precision(fn)`, keeping what the function carries: a deferred aux's halves (BatchNorm's running
    statistics: the microbatch half runs in `dtype`, the finish as it is) and its eval-mode forward."""
    halves = ir.deferred_of(fn)
    out = mixed_precision(fn, dtype) if halves is None else ir.deferred(
        mixed_precision(halves.local, dtype), halves.finish, name=getattr(fn, "__name__", None),
        min_microbatch=halves.min_microbatch, why=halves.why)
    if getattr(fn, "forward", None) is not None:
        out.forward = fn.forward  # type: ignore[attr-defined]
    return out


def _checked(step: Step, entry: plancache.CachedPlan | None, example_batch: Sequence[Any] = (), *,
             measure: bool = False) -> Step:
    """The ranks agree (Step.verify), the plan cache records or checks the programs, CUDA kernels load and
    every program is measured there (Step.profile_programs; elsewhere too with `measure`); elsewhere compiled
    programs compile."""
    with step.setup.phase("verify"):
        programs = step.verify()
    if entry is not None:
        plancache.record_programs(entry, programs, write=step.world.rank == 0)
    if step.world.device.type == "cuda" or measure:  # kernels loaded, programs compiled and measured
        step.profile_programs(*example_batch)
        predicted = step.predicted_step_time
        log.info("rank %d: predicted step %s from the measured programs (planner: %.2f ms)", step.world.rank,
                 "n/a" if predicted is None else f"{predicted * 1e3:.2f} ms", step.plan.predicted_step_time * 1e3)
    elif step.executor.compiler != "fx":
        with step.setup.phase("compile"):
            step.load_programs()  # the ranks wait out each other's compiles here, not in a step
    log.info("rank %d: %s", step.world.rank, step.program)
    for stage, seconds in sorted(step.compile_seconds.items()):
        log.info("rank %d: stage %d compiled in %.1f s (%s)", step.world.rank, stage, seconds, step.executor.compiler)
    return step


def _check_options(compiler: str, check_inputs: str, rebalance: Any = "auto") -> None:
    """Before anything slow or collective: PlanError for an unknown compiler, check_inputs mode or rebalance
    value, or a bad FNPIPE_COMPILE_WAIT."""
    try:
        check_compiler(compiler)
    except ValueError as err:
        raise PlanError(str(err)) from err
    check_mode(check_inputs)
    compile_wait(0.0)
    if not (isinstance(rebalance, bool) or rebalance in ("auto", "step")):
        raise PlanError(f"rebalance={rebalance!r}: give True (re-split from the measured stage programs, on CPU too), "
                        "False (never), \"auto\" (where the programs are measured: CUDA) or \"step\" (re-split "
                        "from the programs' times inside traced steps)")


@attrs.frozen
class _Found:
    planned: Planned
    entry: plancache.CachedPlan | None


def _planned(world: launch.World, workshop: Workshop, loss_fn: Callable, params: Any, batch: Sequence[Any], *,
             schedule: str, build: Callable[..., Any], plan_cache: Any, calibrate: Any, compiler: str,
             options: dict[str, Any], timeout: float = 60.0, clock: SetupClock | None = None) -> _Found:
    """The plan with its artefacts: searched here, or loaded from the plan cache and its stage programs
    built (once each) for it. A calibrated plan is costed as `compiler`'s programs run. `clock` times the
    calibration, the tracing and the rest of the planning."""
    clock = SetupClock() if clock is None else clock
    if calibrate:
        with _tracing(clock, "calibration", workshop):
            table = calibration(world, workshop, calibrate, microbatches=options["microbatches"], dp=options["dp"],
                                compiler=compiler, timeout=timeout)
        options["calibration"] = costed_as_run(table, compiler, world.device)
    with _tracing(clock, "plan", workshop):
        return _plan(world, workshop, loss_fn, params, batch, schedule=schedule, build=build,
                     plan_cache=plan_cache, options=options)


def costed_as_run(table: Calibration, compiler: str, device: torch.device) -> Calibration:
    """The calibration the planner costs `compiler`'s programs with on `device`: its scales (`for_compiler`), and
    its launch ratios unless the step replays CUDA graphs (the host then launches no program)."""
    costed = table.for_compiler(compiler)
    return attrs.evolve(costed, launches={}) if graphs_enabled(device) else costed


@contextmanager
def _tracing(clock: SetupClock, name: str, workshop: Workshop) -> Iterator[None]:
    """Phase `name` timed on `clock`, the tracing done inside it counted as "trace" instead."""
    traced = workshop.trace_seconds
    with clock.phase(name):
        yield
    clock.add("trace", workshop.trace_seconds - traced)
    clock.take(name, workshop.trace_seconds - traced)


def _plan(world: launch.World, workshop: Workshop, loss_fn: Callable, params: Any, batch: Sequence[Any], *,
          schedule: str, build: Callable[..., Any], plan_cache: Any, options: dict[str, Any]) -> _Found:
    if plan_cache is None:
        return _Found(search(loss_fn, params, *batch, world_size=world.size, schedule=schedule, workshop=workshop,
                             build=build, **options), None)
    entry = plancache.load_or_plan(plan_cache, loss_fn, params, *batch, world_size=world.size, schedule=schedule,
                                   write=world.rank == 0, workshop=workshop, build=build, **options)
    if entry.planned is not None:
        return _Found(entry.planned, entry)
    return _Found(planned_from(entry.plan, workshop, table=lowered_table(entry.plan, build)), entry)
