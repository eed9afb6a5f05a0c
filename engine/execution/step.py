"""The Step: one rank's compiled training step, `step(params, *batch) -> (loss, grads)`, and what builds it."""
from __future__ import annotations

import logging

import attrs
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

import ir
from ir.token_mean import token_mean

from ..errors import PlanError, RuntimeMismatchError
from ..planning.artifacts import Planned
from ..planning.plan import fingerprint
from ..setup_clock import SetupClock
from . import launch, routing
from .assemble import Programs, channels, common_fingerprints, disagreements, interface, reduce_groups
from .executor import Executor, Hook
from .footprint import Footprint, footprint
from .graphs import Graphs
from .graphs import enabled as graphs_enabled
from .inputs import Inputs
from .loss_weights import loss_weights
from .post_cost import post_seconds
from .profile import Profile, against_plan, gather, predicted_step_time
from .program import Program
from .spans import Span, Tracer
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


class Step:
    """The compiled training step of one rank. Call `shard` once, then `step(params, *batch)`.

    Each call first checks this rank's params and batch against the plan (no communication: bad input
    raises InputError on every rank that got it); on the steps `check_inputs` names ("first", "every" or
    "never") the ranks also compare fingerprints of their batch and of the params they must hold alike.
    """

    def __init__(self, planned: Planned, world: launch.World, transport: Transport, *, hook: Hook | None = None,
                 compiler: str = "auto", program: Program | None = None, check_inputs: str = "first",
                 setup: SetupClock | None = None) -> None:
        self.planned, self.world, self.transport = planned, world, transport
        self.setup = SetupClock() if setup is None else setup  # parallelize's phases, this Step's among them
        self.plan, self.graph, self.infos, self.table = planned.plan, planned.graph, planned.stages, planned.table
        self.programs = Programs(planned, {world.rank: program} if program is not None else None)
        at = routing.place(self.plan, world.rank)
        self.position, self.replica = at.position, at.dp_replica  # `replica`: which dp replica
        self.microbatches = routing.microbatches(self.plan, world.rank)  # of its dp replica's, that it runs
        self.local_stages = self.table.stages_of(self.position)
        used = {pid for info in self.infos for pid in info.stage.param_ids}
        # a float leaf the loss never reads has grad zeros (as torch.func.grad says); pipeline position 0 holds it
        self.unused = [pid for pid in range(self.graph.num_params) if pid not in used
                       and self.graph.inputs[pid].aval.dtype.is_floating_point]
        mine = {pid for s in self.local_stages for pid in self.infos[s].stage.param_ids}
        self.local_params = sorted(mine | (set(self.unused) if self.position == 0 else set()))
        self.executor = Executor(self.program, self.infos, transport, microbatches=self.plan.microbatches,
                                 dp=self.plan.dp, device=world.device, hook=hook, compiler=compiler)
        if graphs_enabled(world.device):  # CUDA graphs of the compute instructions (FNPIPE_CUDA_GRAPHS)
            self.executor.graphs = Graphs(world.device)
        transport.prepare(largest_receives(self.program, self.executor.layouts))  # collective: copy-engine rings
        self.closed = False
        self.profile: Profile | None = None  # the stage programs measured on the device (profile_programs)
        self.posts: tuple[float | None, ...] | None = None  # per rank, host seconds to post a transfer (same)
        self.rebalanced: Any = None  # parallelize's re-split from the measured programs, if it made one
        self.forward: Callable | None = None  # the eval function step.evaluate runs by default
        self.evaluators: dict[Any, Any] = {}  # (eval function, input shapes) -> its forward-only program
        self.has_aux = ir.returns_aux(self.graph)
        self.token_mean = token_mean(self.graph)  # a loss averaged over the targets it counts (engine/execution/loss_weights.py)
        self.inputs = Inputs(self.graph, microbatches=self.plan.microbatches, dp=self.plan.dp, holders=self.holders(),
                             local=self.local_params, world=world, check=check_inputs)

    def holders(self) -> dict[int, tuple[int, ...]]:
        """Each param leaf -> the world ranks that hold it (its stages' ranks, in every replica)."""
        out: dict[int, set[int]] = {}
        for info in self.infos:
            for pid in info.stage.param_ids:
                out.setdefault(pid, set()).update(routing.position_ranks(self.plan, self.table.rank_of(info.stage.index)))
        for pid in self.unused:  # held by pipeline position 0 of every replica
            out.setdefault(pid, set()).update(routing.position_ranks(self.plan, 0))
        return {pid: tuple(sorted(ranks)) for pid, ranks in sorted(out.items())}

    @property
    def compile_seconds(self) -> dict[int, float]:
        """Seconds each local stage's programs took to compile (their first calls; {} for fx programs)."""
        return self.executor.compile_log.per_stage()

    @property
    def program(self) -> Program:
        """This rank's instruction list."""
        return self.programs[self.world.rank]

    def close(self) -> None:
        """Release what this step holds of the process: its process groups (channels, sums) with their
        sockets and threads, and its compiled programs. The step cannot run afterwards. The world's own
        process group stays for the next `parallelize`; `with engine.parallelize(...) as step:` closes."""
        self.transport.close()
        self.executor.parts.clear()
        if self.executor.graphs is not None:
            if self.world.device.type == "cuda":
                torch.cuda.synchronize(self.world.device)  # no graph may still run when its pool goes
            self.executor.graphs.close()
            self.executor.own_grads.clear()
        self.closed = True

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def verify(self) -> tuple[str, ...]:
        """All ranks must hold the same plan, graph and lowered table, and their programs must fit together
        (every send met by its receive, every sum joined alike); refuse to run otherwise, on every rank.
        Returns every rank's program fingerprint (each rank emitted only its own)."""
        common = {**common_fingerprints(self.planned), "check_inputs setting": fingerprint(self.inputs.check)}
        mine = [common, fingerprint(self.program.to_json()), interface(self.program, self.world.size)]
        prints = self.transport.all_gather_json(mine)  # check_inputs is collective too: its verdict is compared
        bad = [r for r, (common, _, _) in enumerate(prints) if common != prints[0][0]]
        odd = [] if bad else disagreements([face for _, _, face in prints])
        if bad or odd:
            what = _mismatch(prints, bad) if bad else "the ranks' programs do not fit together: " + "; ".join(odd[:4])
            raise RuntimeMismatchError(f"{what}; every rank must call parallelize with the same function, shapes, "
                                       "dtypes and options, and run the same fnpipe")
        return tuple(program for _, program, _ in prints)

    def traced(self, params: Any, *batch: Any) -> tuple[Any, Any, list[Span]]:
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
        return [Span(**s) for part in self.transport.all_gather_json([attrs.asdict(s) for s in spans]) for s in part]

    def memory(self) -> tuple[Footprint, ...]:
        """Every world rank's device bytes for one step (params, grads, buffers, temporaries), replayed
        from its program (`engine.footprint`): what `torch.cuda.max_memory_allocated` reads for programs
        run as fx code, short of library workspaces, with what the transport holds (copy-engine rings).
        Where the programs were measured on the device (`profile_programs`: compiled programs free
        differently from fx), each compute counts the bytes it was seen to make. No optimizer state: that
        is the optimizer's. With CUDA graphs on (`FNPIPE_CUDA_GRAPHS`), the pool's high-water mark and what the
        graphs hold for good (`footprint._Graphed`)."""
        measured = self.profile.peak if self.profile is not None else (lambda key: None)
        graphs = self.executor.graphs is not None and self.executor.graphs.state != "off"
        return tuple(footprint(p, self.infos, self.graph, microbatches=len(routing.microbatches(self.plan, p.rank)),
                               measured=measured, resident=self.transport.resident_bytes(p.rank), graphs=graphs)
                     for p in self.programs.all())  # a rank holds the batch of the microbatches it runs

    def load_programs(self, batch: dict[int, torch.Tensor] | None = None) -> None:
        """Load (compile) every local stage program, running it once on stand-in data (`Executor.warmup`),
        then wait for every rank to be done (`gather_after_compile`: ranks compile for different times); a
        rank that failed raises its own error and every other rank raises RuntimeMismatchError naming it,
        at once rather than after the wait's bound. A collective: every rank calls it."""
        failed = None
        try:
            self.executor.warmup(self.local_stages, batch=batch)
        except Exception as exc:  # noqa: BLE001 -- told to every rank at the gather below, then raised
            failed = exc
        told = self.transport.gather_after_compile(None if failed is None else f"{type(failed).__name__}: {failed}"[:2000])
        if failed is not None:
            raise failed
        others = [(r, why) for r, why in enumerate(told) if why]
        if others:
            raise RuntimeMismatchError(f"rank {others[0][0]} failed to load (compile) its stage programs: "
                                       f"{others[0][1]}; its log has the whole error")

    def profile_programs(self, *example_batch: Any, passes: int = 2) -> Profile:
        """Load and measure every stage program of every rank on its device (a collective: every rank calls
        it; `parallelize` does on CUDA): each program's seconds and the bytes it makes, with the example
        batch's first microbatch for the batch operands. The programs are loaded (compiled) first and the
        ranks wait out each other's compiles (`load_programs`), then time theirs, so no rank times its
        programs beside another's compile. Afterwards `memory()` and `predicted_step_time` come from the
        programs that run (`engine.execution.profile`), each rank's host issuing them and posting its transfers
        at what they cost it (`posts`: `post_cost.post_seconds`). Each program keeps its fastest time over `passes`
        passes over the rank's stages (`Executor.measure`). It resets the device's peak-memory counter
        (torch.cuda.reset_peak_memory_stats)."""
        mb = None
        first = split_batch(example_batch, self.plan.microbatches * self.plan.dp)[0] if example_batch else []
        if first and all(x.device.type != "meta" and not is_fake(x) for x in first):  # else stand-ins throughout
            offset = self.graph.num_params
            mb = {offset + j: x.to(self.world.device).contiguous() for j, x in enumerate(first)}
        with self.setup.phase("compile"):
            self.load_programs(mb)
        with self.setup.phase("measure"):
            self.profile = gather(self.executor.measure(self.local_stages, batch=mb, passes=passes),
                                  self.transport.all_gather_json)
            self.posts = tuple(self.transport.all_gather_json(post_seconds(self.executor)))
        return self.profile

    @property
    def predicted_step_time(self) -> float | None:
        """The step's seconds predicted from the measured programs (`profile_programs`): the plan's schedule
        simulated with every stage's measured F, B and W, plus its dp all-reduce; None before profiling or
        for unequal replicas per stage. `plan.predicted_step_time` is the planner's, from op costs."""
        if self.profile is None:
            return None
        return predicted_step_time(self.plan, self.table, self.programs.all(), self.profile, self.posts,
                                   replayed=self.replays_graphs)

    @property
    def replays_graphs(self) -> bool:
        """Whether the computes run as CUDA graphs (`engine.execution.graphs`; not once they have turned off):
        the host then launches no program, it replays it."""
        graphs = self.executor.graphs
        return graphs is not None and graphs.state != "off"

    def against_plan(self) -> str | None:
        """Per stage, the planner's F and B + W times beside the measured programs' (`profile_programs`), as a
        table; None before profiling."""
        return None if self.profile is None else against_plan(self.plan, self.programs.all(), self.profile)

    def shard(self, params: Any) -> Any:
        """This rank's leaves moved to its device; leaves used only by other ranks become None. Every leaf is
        fingerprinted (no communication): the next cross-rank check (`check_inputs`) compares them."""
        problem = self.inputs.shard_problem(params)
        if problem is not None:
            raise problem
        leaves, tree = pytree.tree_flatten(params, is_leaf=lambda x: x is None)
        if self.inputs.check != "never":
            self.inputs.record_shard(params)
        keep = set(self.local_params)
        out = [x.detach().to(self.world.device) if i in keep else None for i, x in enumerate(leaves)]
        return pytree.tree_unflatten(out, tree)

    def __call__(self, params: Any, *batch: Any) -> tuple[Any, Any]:
        """`(loss, grads)`, or `((loss, aux), grads)` for a loss function planned with has_aux=True."""
        if self.closed:
            raise PlanError("this step was closed (step.close() or the end of its `with` block); call "
                            "engine.parallelize again for a new one")
        leaves, tree = pytree.tree_flatten(params, is_leaf=lambda x: x is None)
        problem = self.inputs.problem(params, batch, (leaves, tree))  # this rank alone: no communication
        if self.inputs.due(self.transport.world_size):
            self.inputs.agree(self.transport, problem, params, batch)
        elif problem is not None:
            raise problem.error
        local = {pid: leaves[pid] for pid in self.local_params}
        m, dp = self.plan.microbatches, self.plan.dp
        every = split_batch(batch, m * dp)
        weights = loss_weights(self.token_mean, every)  # a mean over counted targets (ignore_index): exact
        chunks = every[self.replica * m:(self.replica + 1) * m]
        offset, mine = self.graph.num_params, set(self.microbatches)  # only what this rank runs goes to its device
        mbs = [{offset + j: x.to(self.world.device) for j, x in enumerate(c)} if i in mine else {}
               for i, c in enumerate(chunks)]
        mine_w = None if weights is None else weights[self.replica * m:(self.replica + 1) * m]  # this dp replica's
        loss, grads = self.executor.run(local, mbs, mine_w)
        self.transport.settle("finishing the step")  # copy-engine channels: no loss a failure may have touched
        for pid in self.unused:
            if pid in local and pid not in grads:
                grads[pid] = torch.zeros_like(local[pid])
        out = [grads.get(pid) if pid in local else None for pid in range(len(leaves))]
        if self.has_aux:
            loss = pytree.tree_unflatten([loss, *self.executor.aux], self.graph.out_tree)
            if self.planned.finish is not None:  # a deferred aux: finished on the average of every microbatch's part
                loss = (loss[0], self.planned.finish(loss[1], m * dp))
        return loss, pytree.tree_unflatten(out, tree)

    def evaluate(self, params: Any, *inputs: Any, forward: Callable | None = None, gather: str = "all") -> Any:
        """The outputs of `forward(params, *inputs)` (default: the eval-mode forward that engine.functionalize
        attaches to its function) run forward-only on this plan's stages and ranks, without planning again;
        `gather` "all" (every rank, the full batch) or "local" (the last stage's ranks, their replica's rows;
        None elsewhere). Every rank must call it (engine/execution/evaluate.py)."""
        from .evaluate import GATHER, Evaluator

        forward = forward or self.forward
        if forward is None or gather not in GATHER:
            raise PlanError("step.evaluate needs an eval function: pass forward=fn(params, *inputs) -> outputs, or "
                            "parallelize a function made by engine.functionalize (it carries the module's eval-mode "
                            "forward)" if forward is None else f"gather must be one of {GATHER}, got {gather!r}")
        key = (forward, tuple((tuple(x.shape), x.dtype) for x in pytree.tree_leaves(tuple(inputs))))
        if key not in self.evaluators:
            self.evaluators[key] = Evaluator(self, forward, params, inputs)
            self.evaluators[key].verify()
        out = self.evaluators[key](params, inputs, gather)
        self.transport.settle("finishing evaluate")
        return out

    def gather(self, tree: Any) -> Any:
        """The full tree on rank 0 (each leaf from the first replica's rank that holds it); None elsewhere."""
        import torch.distributed as dist

        leaves, spec = pytree.tree_flatten(tree, is_leaf=lambda x: x is None)
        if self.world.size == 1:
            return tree
        owner = {pid: routing.position_ranks(self.plan, self.table.rank_of(
                     min(s for s in range(len(self.infos)) if pid in self.infos[s].stage.param_ids)))[0]
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


def largest_receives(program: Program, layouts: Callable[[Any], Any]) -> dict[int, int]:
    """Each peer this rank receives from -> the bytes of the largest message it receives from it in `program`."""
    out: dict[int, int] = {}
    for ins in program.instrs:
        for c in ins.comm:
            if c.op == "recv":
                out[c.peer] = max([out.get(c.peer, 0), *(m.nbytes for m in layouts(c).messages)])
    return out


def connect(world: launch.World, planned: Planned, timeout: float) -> Transport:
    """This rank's transport: the channels and reduction groups any rank of the plan uses (from the table)."""
    if not world.distributed:
        return LocalTransport(Hub(1, timeout), 0)
    return DistTransport(timeout, reduce_groups(planned), channels(planned), world.device)


def _mismatch(prints: list, bad: list[int]) -> str:
    """Which ranks differ from rank 0, and in what: 'ranks [1] built a different plan (memory_limit) than rank 0'."""
    first = prints[0][0]
    keys = [k for k, v in first.items() if any(prints[r][0].get(k) != v for r in bad)]
    fields = [k[len("plan."):] for k in keys if k.startswith("plan.")]
    parts = ([f"plan ({', '.join(fields)})"] if fields else []) + [k for k in keys if not k.startswith("plan.")]
    said = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return (f"ranks {bad} built a different {said} than rank 0 (fingerprints "
            f"{[prints[r][0].get(keys[0], '')[:12] for r in range(len(prints))]})")
