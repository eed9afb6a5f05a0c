"""`engine.parallelize`: a pure loss function becomes a pipelined `step(params, *batch) -> (loss, grads)`."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

import ir
import schedules

from . import launch
from .emit import StageInfo, emit, grad_groups
from .errors import PlanError, RuntimeMismatchError
from .footprint import Footprint, footprint
from .instructions import Program, fingerprint
from .plan import Plan
from .runtime import Executor, Hook, check_compiler
from .tracing import Span, Tracer
from .transport import DistTransport, Hub, LocalTransport, Transport

log = logging.getLogger("engine.runtime")


def split_batch(batch: Sequence[Any], parts: int) -> list[list[torch.Tensor]]:
    """Each batch leaf cut along dim 0 into `parts` equal chunks: result[k] = flat leaves of chunk k."""
    leaves = pytree.tree_leaves(tuple(batch))
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % parts:
            size = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() else "no batch dim"
            raise PlanError(f"batch leaf {i} has batch size {size}, which does not split into {parts} equal "
                            "microbatches (microbatches x dp); pick a batch size that is a multiple of it")
    chunks = [torch.tensor_split(x, parts, dim=0) for x in leaves]
    return [[c[k] for c in chunks] for k in range(parts)]


def microbatch_example(batch: Sequence[Any], parts: int) -> tuple[Any, ...]:
    """The example batch's first microbatch, with the user's pytree structure."""
    leaves, tree = pytree.tree_flatten(tuple(batch))
    return tuple(pytree.tree_unflatten(split_batch(batch, parts)[0], tree))


def stage_infos(graph: ir.Graph, plan: Plan, device: torch.device) -> list[StageInfo]:
    """Every stage's slice and F/B/W programs (all ranks build all, so they can check each other)."""
    infos = []
    for st in ir.split(graph, plan.cuts):
        const = range(len(st.param_ids), len(st.param_ids) + len(st.batch_ids))
        ad = ir.stage_autodiff(st.graph, constant=const, device=str(device), recompute=plan.recompute[st.index])
        infos.append(StageInfo(st, ad))
    return infos


def build_programs(infos: Sequence[StageInfo], plan: Plan, num_params: int) -> tuple[schedules.Table, list[Program]]:
    table = plan.table()
    if not table.is_lowered:  # a user's schedule may come with its communication placed by hand
        table = schedules.lower(table)
    schedules.validate(table)
    progs = [emit(infos, table, world_rank=r, dp=plan.dp, num_params=num_params) for r in range(plan.world_size)]
    return table, progs


class Step:
    """The compiled training step of one rank. Call `shard` once, then `step(params, *batch)`."""

    def __init__(self, fn: Callable, graph: ir.Graph, plan: Plan, world: launch.World, transport: Transport,
                 *, hook: Hook | None = None, infos: Sequence[StageInfo] | None = None,
                 programs: tuple[schedules.Table, list[Program]] | None = None, compiler: str = "fx") -> None:
        self.fn, self.graph, self.plan, self.world, self.transport = fn, graph, plan, world, transport
        self.infos = list(infos) if infos is not None else stage_infos(graph, plan, world.device)
        self.table, self.programs = programs or build_programs(self.infos, plan, graph.num_params)
        self.position = world.rank % plan.pipeline_depth
        self.replica = world.rank // plan.pipeline_depth
        self.local_stages = self.table.stages_of(self.position)
        self.local_params = sorted({pid for s in self.local_stages for pid in self.infos[s].stage.param_ids})
        self.executor = Executor(self.program, self.infos, transport, microbatches=plan.microbatches,
                                 dp=plan.dp, device=world.device, hook=hook, compiler=compiler)

    @property
    def program(self) -> Program:
        """This rank's instruction list."""
        return self.programs[self.world.rank]

    def verify(self) -> None:
        """All ranks must hold the same plan and program set; refuse to run otherwise."""
        mine = fingerprint([self.plan.to_json(), self.graph_hash(), [p.to_json() for p in self.programs]])
        prints = self.transport.all_gather_object(mine)
        bad = [r for r, f in enumerate(prints) if f != prints[0]]
        if bad:
            raise RuntimeMismatchError(f"ranks {bad} built a different plan or program than rank 0 (fingerprints "
                                       f"{[f[:12] for f in prints]}); every rank must call parallelize with the "
                                       "same function, shapes, dtypes and options")

    def traced(self, params: Any, *batch: Any) -> tuple[torch.Tensor, Any, list[Span]]:
        """One step with every instruction timed (CUDA events on GPU); returns this rank's spans too."""
        self.executor.tracer = Tracer(self.world.rank, self.world.device)
        try:
            loss, grads = self(params, *batch)
            spans = self.executor.tracer.spans
        finally:
            self.executor.tracer = None
        return loss, grads, spans

    def all_spans(self, spans: list[Span]) -> list[Span]:
        """Every rank's spans (a collective: call it on all ranks)."""
        return [s for part in self.transport.all_gather_object(spans) for s in part]

    def graph_hash(self) -> str:
        return fingerprint(str(self.graph))

    def memory(self) -> tuple[Footprint, ...]:
        """Every world rank's device bytes for one step (params, grads, buffers, temporaries), replayed
        from its program (`engine.footprint`): what `torch.cuda.max_memory_allocated` reads for programs
        run as fx code, short of library workspaces (inductor-compiled programs free differently; the
        benchmark saw them within -16 % / +8 % of this). No optimizer state: that is the optimizer's."""
        return tuple(footprint(p, self.infos, self.graph, microbatches=self.plan.microbatches)
                     for p in self.programs)

    def shard(self, params: Any) -> Any:
        """This rank's leaves moved to its device; leaves used only by other ranks become None."""
        leaves, tree = pytree.tree_flatten(params)
        keep = set(self.local_params)
        out = [x.detach().to(self.world.device) if i in keep else None for i, x in enumerate(leaves)]
        return pytree.tree_unflatten(out, tree)

    def __call__(self, params: Any, *batch: Any) -> tuple[torch.Tensor, Any]:
        leaves, tree = pytree.tree_flatten(params, is_leaf=lambda x: x is None)
        if len(leaves) != self.graph.num_params:
            raise PlanError(f"params has {len(leaves)} leaves, the traced function {self.graph.num_params}; "
                            "pass the tree returned by step.shard(params)")
        local = {}
        for pid in self.local_params:
            x = leaves[pid]
            want = self.graph.inputs[pid].aval
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want.shape or x.dtype != want.dtype:
                got = ir.AbstractValue.of(x) if isinstance(x, torch.Tensor) else repr(x)
                raise PlanError(f"param '{self.graph.input_names[pid]}' on rank {self.world.rank} should be "
                                f"{want}, got {got}; pass the tree from step.shard(params)")
            local[pid] = x
        m, dp = self.plan.microbatches, self.plan.dp
        chunks = split_batch(batch, m * dp)[self.replica * m:(self.replica + 1) * m]
        offset = self.graph.num_params
        mbs = [{offset + j: x.to(self.world.device) for j, x in enumerate(c)} for c in chunks]
        loss, grads = self.executor.run(local, mbs)
        out = [grads.get(pid) if pid in local else None for pid in range(len(leaves))]
        return loss, pytree.tree_unflatten(out, tree)

    def gather(self, tree: Any) -> Any:
        """The full tree on rank 0 (each leaf from the first replica's rank that holds it); None elsewhere."""
        import torch.distributed as dist

        leaves, spec = pytree.tree_flatten(tree, is_leaf=lambda x: x is None)
        if self.world.size == 1:
            return tree
        owner = {pid: self.table.rank_of(min(s for s in range(len(self.infos)) if pid in self.infos[s].stage.param_ids))
                 for pid in range(len(leaves)) if any(pid in i.stage.param_ids for i in self.infos)}
        out = list(leaves) if self.world.rank == 0 else None
        for pid, src in sorted(owner.items()):
            if src == 0:
                continue
            aval = self.graph.inputs[pid].aval
            if self.world.rank == src:
                dist.send(leaves[pid].detach().contiguous(), dst=0)
            elif self.world.rank == 0:
                buf = torch.empty(aval.shape, dtype=aval.dtype, device=self.world.device)
                dist.recv(buf, src=src)
                out[pid] = buf
        return pytree.tree_unflatten(out, spec) if out is not None else None


def calibration(world: launch.World, loss_fn: Callable, params: Any, batch: Sequence[Any], microbatches: Any,
                dp: Any, where: bool | str | os.PathLike) -> Any:
    """Rank 0 times the model's ops on its device, all ranks get the table. A table saved at `where` is
    loaded first and only the signatures it lacks are timed (another microbatch size or dp makes new
    shapes); the grown table is saved back. If rank 0 fails, every rank raises with its error."""
    table, error = None, None
    if world.rank == 0:
        try:
            table = _calibrate_here(world, loss_fn, params, batch, microbatches, dp, where)
        except Exception as exc:  # noqa: BLE001 -- re-raised below, after the others have heard of it
            error = exc
    if world.distributed:  # always: rank 0's table wins, whatever each rank found on disk
        import torch.distributed as dist

        box = [(table, None if error is None else f"{type(error).__name__}: {error}")]
        dist.broadcast_object_list(box, src=0)
        table, message = box[0]
        if message is not None and error is None:
            raise PlanError(f"calibration failed on rank 0 ({message}); fix that run, or pass calibrate=False")
    if error is not None:
        raise error
    return table


def _calibrate_here(world: launch.World, loss_fn: Callable, params: Any, batch: Sequence[Any], microbatches: Any,
                    dp: Any, where: bool | str | os.PathLike) -> Any:
    from .calibrate import Calibration, calibrate_training

    path = None if where is True else os.fspath(where)
    known = Calibration.load(path) if path is not None and os.path.exists(path) else None
    parts = (microbatches if isinstance(microbatches, int) else world.size) * (dp if isinstance(dp, int) else 1)
    example = microbatch_example(batch, parts)
    graph = ir.trace(loss_fn, params, *example, device=world.device)
    real = pytree.tree_leaves((params, example))
    inputs = real if all(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in real) else None
    table = calibrate_training(graph, world.device, calibration=known, inputs=inputs)
    if path is not None and table != known:
        table.save(path)
    return table


def channels(programs: Sequence[Program]) -> list[tuple[int, int]]:
    """Every ordered (sender, receiver) pair that any program uses."""
    return sorted({(p.rank, c.peer) if c.op == "send" else (c.peer, p.rank)
                   for p in programs for ins in p.instrs for c in ins.comm})


def make_transport(world: launch.World, programs: Sequence[Program], infos: Sequence[StageInfo], plan: Plan,
                   num_params: int, timeout: float) -> Transport:
    if not world.distributed:
        return LocalTransport(Hub(1, timeout), 0)
    groups = list(grad_groups(infos, plan.table(), num_params, plan.dp))
    return DistTransport(timeout, groups, channels(programs), world.device)


def parallelize(loss_fn: Callable, params: Any, *example_batch: Any, schedule: str = "1f1b",
                microbatches: int | str = 8, stages: int | str | None = None, dp: int | str | None = None,
                memory_limit: int | None = None, stages_per_rank: int | None = None,
                cuts: Sequence[int] | None = None, timeout: float = 60.0, hook: Hook | None = None,
                plan_cache: str | os.PathLike | None = None,
                calibrate: bool | str | os.PathLike = False, recompute: bool | str = "auto",
                compute_dtype: torch.dtype | None = None, compiler: str = "fx") -> Step:
    """Trace, plan, emit and check the pipelined step of `loss_fn` for this job (see README).

    For a loss that is a mean over the batch, `step(params, *batch)` returns the full-batch loss on
    every rank and grads equal to `torch.func.grad(loss_fn)(params, *batch)` on the leaves this rank
    holds (None elsewhere), for every schedule, stage count, microbatch count and dp degree.
    `plan_cache` (a directory, or a .json deployment file) reuses a plan made for the same model,
    world, schedule and options instead of planning again (engine.plancache). `calibrate=True` times
    every op of the model once on rank 0's device before splitting, so the split balances measured
    rather than roofline costs; a path reuses (or writes) that table, so reruns and plan caches agree.
    `recompute` is activation recomputation: False, True (every stage) or "auto" (only the stages that
    do not fit memory without it; `step.plan.recompute` says which). `compute_dtype` (e.g.
    torch.bfloat16) runs the model with its float params cast to that dtype inside the graph while
    params and grads keep theirs (engine.precision.mixed_precision; grads are then those of that function).
    `compiler` runs each stage program as generated fx Python ("fx", the default: eager's kernels, no
    compile time) or compiled by torch.compile's inductor ("inductor": fused kernels, a compile per
    stage program at the first step).
    """
    from . import plancache
    from .planner import plan as make_plan

    if compute_dtype is not None:
        from .precision import mixed_precision

        loss_fn = mixed_precision(loss_fn, compute_dtype)
    try:  # before anything slow; the registry's message suggests the closest name
        check_compiler(compiler)
        schedules.get(schedule)
    except (schedules.ScheduleError, ValueError) as err:
        raise PlanError(str(err)) from err
    world = launch.init(timeout)
    options = dict(stages=stages, dp=dp, microbatches=microbatches, memory_limit=memory_limit,
                   device=world.device.type, stages_per_rank=stages_per_rank, cuts=cuts, recompute=recompute)
    if calibrate:
        options["calibration"] = calibration(world, loss_fn, params, example_batch, microbatches, dp, calibrate)
    entry = None
    if plan_cache is not None:
        entry = plancache.load_or_plan(plan_cache, loss_fn, params, *example_batch, world_size=world.size,
                                       schedule=schedule, write=world.rank == 0, **options)
        p = entry.plan
    else:
        p = make_plan(loss_fn, params, *example_batch, world_size=world.size, schedule=schedule, **options)
    mb_example = microbatch_example(example_batch, p.microbatches * p.dp)
    graph = ir.trace(loss_fn, params, *mb_example, device=world.device)
    infos = stage_infos(graph, p, world.device)
    table, programs = build_programs(infos, p, graph.num_params)
    if entry is not None:
        plancache.record_programs(entry, programs, write=world.rank == 0)
    transport = make_transport(world, programs, infos, p, graph.num_params, timeout)
    step = Step(loss_fn, graph, p, world, transport, hook=hook, infos=infos, programs=(table, programs),
                compiler=compiler)
    step.verify()
    if world.device.type == "cuda":
        step.executor.warmup(step.local_stages)
    log.info("rank %d: %s", world.rank, step.program)
    return step
