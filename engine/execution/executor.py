"""The runtime: executes one rank's static Program, one small handler per instruction kind."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import ir

from ..planning.calibration import settle_seconds
from .calls import Call, Groups, prepare
from .compilers import COMPILERS, CompileLog, check_compiler, resolve  # noqa: F401 -- check_compiler re-exported
from .emit import StageInfo
from .graphs import Graphs
from .packing import Layouts
from .profile import Key, Profile, ProgramCost, faster_of, first_instructions, measure, program_label
from .program import COMPUTE, Instr, Program
from .spans import UNTRACED, Tracer
from .transport import Transport

Hook = Callable[["Executor", Instr], "str | None"]  # return "skip" to skip the instruction (test faults)


class Executor:
    """Runs a Program over a Transport for one step: buffers live in a dict and die at `free`."""

    def __init__(self, program: Program, infos: Sequence[StageInfo], transport: Transport, *,
                 microbatches: int, dp: int, device: torch.device, hook: Hook | None = None,
                 compiler: str = "fx") -> None:
        self.program, self.infos, self.transport = program, infos, transport
        self.m, self.dp, self.device, self.hook = microbatches, dp, device, hook
        self.compiler = resolve(compiler, device)  # "auto": inductor on CUDA, fx elsewhere
        self.compile = COMPILERS[self.compiler]
        self.compile_log = CompileLog()
        self.tracer: Tracer | None = None
        self.annotate = False  # name each compute in a profiler trace (`profile.program_label`): diagnostics only
        self.capture: dict[Key, tuple[list[Any], list[torch.Tensor]]] | None = None  # `measure_captured`: diagnostics
        self.graphs: Graphs | None = None  # CUDA graphs of the compute instructions (`graphs`), set by the Step
        self.own_grads: dict[int, torch.Tensor] = {}  # with graphs: accumulators that outlive a step
        self.parts: dict[tuple[int, str, tuple[int, ...]], Callable[..., Any]] = {}  # (stage, kind, accumulate)
        self.layouts = Layouts(infos)  # each transfer's messages (`packing`)
        self.groups: Groups = {}
        self.calls = prepare(program, infos, self.groups)  # each compute's operands by source (`calls`)
        self.templates: dict[int, list[Any]] = {}  # per Call.group: its parameter operands, this step
        last = infos[-1]
        self.loss_dtype = last.stage.graph.outputs[last.loss_index].aval.dtype
        self.aux_avals = [last.stage.graph.outputs[j].aval for j in last.aux_indices()]  # has_aux: every rank sums them
        self.aux: list[torch.Tensor] = []
        self.weights: Sequence[float] | torch.Tensor | None = None  # per microbatch, this step (`run`)
        summed = [_summed(self.loss_dtype), *(_summed(a.dtype) for a in self.aux_avals)]
        self.sum_groups = [[k for k, d in enumerate(summed) if d == dtype] for dtype in dict.fromkeys(summed)]

    # -- one step -------------------------------------------------------------------------------
    def run(self, params: dict[int, torch.Tensor], microbatches: Sequence[dict[int, torch.Tensor]],
            weights: Sequence[float] | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One step. `weights`: each microbatch's share of the loss (`loss_weights`: numbers, or a tensor on the
        device), else 1 / (m x dp) each."""
        self.params, self.mbs = params, microbatches
        self.weights = weights.to(self.device) if isinstance(weights, torch.Tensor) else weights  # the batch's device
        self.bufs: dict[str, torch.Tensor] = {}
        self.pending: dict[str, Any] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.grads: dict[int, torch.Tensor] = {}
        self.templates = {}
        self.loss, *self.aux = self._totals()
        tracer = self.tracer
        if tracer is not None:
            tracer.begin_step()
        graphs = self.graphs
        if graphs is not None:
            graphs.begin_step()
        ok = False
        try:
            for ins in self.program.instrs:
                if self.hook is not None and self.hook(self, ins) == "skip":
                    continue
                if tracer is not None and ins.kind not in UNTRACED:
                    opened = tracer.around(ins)
                    HANDLERS[ins.kind](self, ins)
                    tracer.close(opened)
                else:
                    HANDLERS[ins.kind](self, ins)
            self._drain_sends()
            ok = True
        finally:
            if graphs is not None:
                graphs.end_step(ok)
        if tracer is not None:
            tracer.end_step()
        if self.own_grads:  # the accumulators outlive the step: the caller gets copies (one multi-tensor kernel),
            # also of views of them (a sum over ranks may hand back a view of a lone accumulator)
            own = {g.untyped_storage().data_ptr() for g in self.own_grads.values()}
            mine = [pid for pid, g in self.grads.items() if g.untyped_storage().data_ptr() in own]
            if mine:
                self.grads.update(zip(mine, torch._foreach_mul([self.grads[p] for p in mine], 1.0)))
        # the user's loss and aux leaves on storage of their own (one multi-tensor kernel), not views keeping the
        # flat totals alive (a ResNet-101's are 4.8 MiB: a kept loss would hold all of it)
        self.loss, *self.aux = torch._foreach_mul([self.loss, *self.aux], 1.0)
        return self.loss, self.grads

    def _totals(self) -> list[torch.Tensor]:
        """Zeroed loss and aux totals, each group of one summing dtype (`sum_groups`) views of one flat buffer:
        one fill a step, and `reduce_loss` sums each buffer in place (a BatchNorm net has a hundred aux leaves);
        `run` hands out copies."""
        shapes = [(), *(a.shape for a in self.aux_avals)]
        dtypes = [_summed(self.loss_dtype), *(_summed(a.dtype) for a in self.aux_avals)]
        out: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
        self.flat_totals = []
        for group in self.sum_groups:
            sizes = [math.prod(shapes[k]) for k in group]
            flat = torch.zeros(sum(sizes), dtype=dtypes[group[0]], device=self.device)
            self.flat_totals.append(flat)
            for k, piece in zip(group, flat.split(sizes)):
                out[k] = piece.view(shapes[k])
        return out

    def _annotation(self, call: Call) -> Any:
        """A profiler range named by the compute's program (`program_label`) when `annotate` is on, else none: the
        program's run alone, as `measure` times it (not the zeroed accumulators or copies made before it)."""
        if not self.annotate:
            return contextlib.nullcontext()
        return torch.profiler.record_function(program_label((call.stage, call.kind, call.accumulate)))

    def warmup(self, stages: Sequence[int], *, batch: dict[int, torch.Tensor] | None = None) -> None:
        """Run each local stage's programs (F, then B and W or BW as this rank's program does) once on
        stand-in data, with no communication, so that every kernel is loaded and every library handle made
        before a step (on GPU a kernel loaded lazily while an NCCL kernel spins can deadlock; `parallelize`
        calls it there, not on CPU). `batch`: one microbatch's leaves for the batch operands (real token ids
        rather than zeros)."""
        for _ in self._stand_in_runs(stages, batch):
            pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, stages: Sequence[int], *, batch: dict[int, torch.Tensor] | None = None, passes: int = 2
                ) -> tuple[ProgramCost, ...]:
        """Each local stage program (loaded by `warmup`) timed and its bytes counted on the device
        (`engine.execution.profile.measure`), a stage at a time (one stage's stand-ins are held at once), in
        `passes` passes over the stages, each program keeping the fastest of its times (`faster_of`): a stage
        measured while the device or host is still busy with what came before reads slow (4 x H100,
        2026-11-26, GPT zbv after a compiled PyTorch row in the same launch: the first stage measured on
        every rank read 1.25-1.94 x the same programs' times in two other launches, the second stage
        0.97-1.00 x). Each pass's first stage runs `settle_seconds` untimed first, the later ones a quarter of
        it (the device stays busy from one stage to the next), so the device is timed at the clock a step holds."""
        settle = settle_seconds(self.device)
        timed = [Profile(cost for k, runs in enumerate(self._stand_in_runs(stages, batch))
                         for cost in measure(runs, self.device, settle=settle if k == 0 else settle / 4))
                 for _ in range(max(1, passes))]
        return functools.reduce(faster_of, timed).programs

    def measure_captured(self, *, passes: int = 2) -> tuple[ProgramCost, ...]:
        """The programs `capture` saw in a step, timed in turn on the operands that step gave them (the real
        activations and cotangents where `measure` uses stand-ins), each stage's F, then B, W or BW as
        `measure` orders them; accumulators are fresh zeros, so the step's grads are not touched. A
        diagnostic: is a program slower in a step because of its data? Empty without a capture."""
        captured = self.capture or {}
        order = {kind: k for k, kind in enumerate(COMPUTE)}
        stages = sorted({key[0] for key in captured})
        runs = [[(key, functools.partial(self._part(*key), *args, *[torch.zeros_like(a) for a in accs]))
                 for key, (args, accs) in sorted(captured.items(), key=lambda kv: (order[kv[0][1]], kv[0][2]))
                 if key[0] == s] for s in stages]
        settle = settle_seconds(self.device)
        timed = [Profile(cost for k, stage_runs in enumerate(runs)
                         for cost in measure(stage_runs, self.device, settle=settle if k == 0 else settle / 4))
                 for _ in range(max(1, passes))]
        return functools.reduce(faster_of, timed).programs if timed and runs else ()

    def _stand_in_runs(self, stages: Sequence[int], batch: dict[int, torch.Tensor] | None
                       ) -> Iterator[list[tuple[Key, Callable[[], Any]]]]:
        """Per stage, every distinct program it runs here, run once in order (each one's outputs feed the
        next), then yielded with its operands bound; the stand-ins die with the stage."""
        first = first_instructions(self.program)
        for s in stages:
            ad = self.infos[s].ad
            slots = {i: stand_in(a, self.device) for i, a in enumerate(ad.slot_avals) if a is not None}
            runs = []
            for kind in COMPUTE:
                for key in [k for k in first if k[:2] == (s, kind)]:
                    part, acc = getattr(ad, kind), key[2]
                    args = [slots[i] for i in part.in_slots]
                    for pos, leaf in self.calls[id(first[key])].batch if batch else ():
                        args[pos] = batch[leaf]  # type: ignore[index]
                    args += [stand_in(ad.slot_avals[part.out_slots[k]], self.device).zero_() for k in acc]
                    fn = self._part(s, kind, acc)
                    outs = fn(*args)
                    slots.update((slot, out) for slot, out in zip(part.out_slots, outs) if out is not None)
                    runs.append((key, functools.partial(fn, *args)))
            yield runs
            del slots, runs  # before the next stage's stand-ins are made

    def _part(self, stage: int, kind: str, accumulate: tuple[int, ...] = ()) -> Callable[..., Any]:
        key = (stage, kind, accumulate)
        if key not in self.parts:
            self.parts[key] = self.compile_log.wrap(self.compile, stage, kind, getattr(self.infos[stage].ad, kind).graph,
                                                    accumulate)
        return self.parts[key]

    def accumulator(self, leaf: int) -> torch.Tensor:
        """The grad accumulator of parameter `leaf` (`g<leaf>`), zeros at its first use in a step: compiled W / BW
        programs add each weight grad into it as soon as it is made (see `ir.compile_graph`'s `accumulate`)."""
        if leaf not in self.grads:
            if self.graphs is not None and self.graphs.active:  # a graph adds into it: the same tensor every step
                own = self.own_grads.get(leaf)
                if own is None:
                    own = self.own_grads[leaf] = torch.zeros_like(self.params[leaf],
                                                                  memory_format=torch.contiguous_format)
                else:
                    own.zero_()
                self.grads[leaf] = own
            else:
                self.grads[leaf] = torch.zeros_like(self.params[leaf], memory_format=torch.contiguous_format)
        return self.grads[leaf]

    # -- operands -------------------------------------------------------------------------------
    def read(self, ref: str, mb: int) -> torch.Tensor:
        kind, idx = ref[0], int(ref[1:])
        if kind == "p":
            return self.params[idx]
        if kind == "x":
            return self.mbs[mb][idx]
        return self.buffer(ref)

    def buffer(self, ref: str) -> torch.Tensor:
        """Buffer `ref`, once its receive (if it is one still pending) has been waited on."""
        if ref in self.pending:
            self.pending.pop(ref).wait(self.transport, ref)
        return self.bufs[ref]

    def _retire_sends(self) -> None:
        """Forget sends that have finished. Sends are never waited on mid-step: on NCCL that would make
        compute wait for the peer; the tensors stay referenced here until their transfer is done."""
        if self.graphs is not None and self.graphs.capturing:
            return  # a capture step keeps every sent tensor to its end: no graph may reuse what a send still reads
        self.sends = [(w, t) for w, t in self.sends if w is not None and not w.is_completed()]

    def _drain_sends(self) -> None:
        for work, _ in self.sends:
            self.transport.wait(work, "sending")
        self.sends = []

    # -- handlers -------------------------------------------------------------------------------
    def compute(self, ins: Instr) -> None:
        call = self.calls.get(id(ins)) or self._prepare(ins)
        args = self._param_args(call)
        mb = self.mbs[call.mb] if call.batch else None
        for pos, leaf in call.batch:
            args[pos] = mb[leaf]  # type: ignore[index]
        for pos, ref in call.buffers:
            args[pos] = self.buffer(ref)
        if self.tracer is not None:
            self.tracer.ready()
        # Stage inputs and cotangents were traced as contiguous placeholders; a value handed over on the
        # same rank (zbv's turn of the V) or given by the user may not be, and a traced `view` needs it.
        graphed = self.graphs is not None and self.graphs.active
        inside = []  # with graphs, a buffer's copy is made inside the graph: in its pool, not held for good
        for pos, where in [(pos, "user") for pos, _ in call.batch] + [(pos, "runtime") for pos, _ in call.buffers]:
            if pos in call.contiguous and not args[pos].is_contiguous():
                if graphed and where == "runtime":
                    inside.append(pos)
                else:
                    args[pos] = args[pos].contiguous()
        accs = [self.accumulator(p) for p in call.grads]
        if self.capture is not None:
            self.capture.setdefault((call.stage, call.kind, call.accumulate),
                                    ([a.contiguous() if k in inside else a for k, a in enumerate(args)], accs))
        key = (call.stage, call.kind, call.accumulate)
        with self._annotation(call):
            if graphed:
                users = [pos for pos, _ in (*call.params, *call.batch)]  # the user's tensors: never written
                part = self._part(*key)
                outs = self.graphs.run(id(ins), key, _contiguous_at(part, inside) if inside else part,
                                       [*args, *accs], users)
            else:
                outs = self._part(*key)(*args, *accs)
        self.bufs.update((ref, outs[k]) for k, ref in call.writes)

    def _prepare(self, ins: Instr) -> Call:
        """A compute instruction not in the program: prepared for this call only (an id is only unique while its
        object lives, and the program's instructions are the ones that live as long as the Executor)."""
        return prepare(Program(-1, (ins,)), self.infos, self.groups)[id(ins)]

    def _param_args(self, call: Call) -> list[Any]:
        """A fresh argument list with the call's parameters in place: built once a step per parameter group."""
        template = self.templates.get(call.group)
        if template is None:
            template = [None] * call.size
            for pos, leaf in call.params:
                p = self.params[leaf]
                template[pos] = p.contiguous() if pos in call.contiguous and not p.is_contiguous() else p
            self.templates[call.group] = template
        return template.copy()

    def comm(self, ins: Instr) -> None:
        """Post every transfer of the group, each as its layout's messages (small tensors packed: `packing`)."""
        self._retire_sends()
        ops: list[tuple[str, int, torch.Tensor]] = []
        waits: list[tuple[str, ...] | None] = []  # per recv message, the refs that wait on it
        for c in ins.comm:
            lay = self.layouts(c)
            if c.op == "send":
                sent = lay.send([self.read(ref, c.mb) for ref in c.bufs])
                ops += [("send", c.peer, t) for t in sent]
                waits += [None] * len(sent)
                continue
            with self.transport.receiving(c.peer):  # gated receives take buffers from their own pool
                bufs, views = lay.receive(self.device)
            self.bufs.update(zip(c.bufs, views))
            ops += [("recv", c.peer, t) for t in bufs]
            waits += [tuple(c.bufs[k] for k in m.members) for m in lay.messages]
        for (op, _, t), h, refs in zip(ops, self.transport.post(ops, pooled=True), waits):
            if refs is None:
                self.sends.append((h, t))
                continue
            shared = _Pending(h)
            for ref in refs:
                self.pending[ref] = shared

    def free(self, ins: Instr) -> None:
        for ref in ins.reads:
            self.bufs.pop(ref, None)

    def loss_grad(self, ins: Instr) -> None:
        share = 1.0 / (self.m * self.dp) if self.weights is None else self.weights[ins.mb]
        self.bufs[ins.writes[0]] = (share.to(dtype=self.loss_dtype) if isinstance(share, torch.Tensor) else
                                    torch.full((), share, dtype=self.loss_dtype, device=self.device))

    def add_loss(self, ins: Instr) -> None:
        """The microbatch's loss and aux leaves, each added as its share of the mean over dp x microbatches:
        `total += leaf.to(total.dtype) / (m * dp)`, as two multi-tensor (`_foreach_`) ops per dtype of the
        totals rather than two ops per leaf (a BatchNorm net has a few partial statistics per layer). With
        `weights` (a loss averaged over counted targets) the loss adds `weight x loss` instead; aux leaves
        keep the uniform share."""
        totals = (self.loss, *self.aux)
        values = [self.read(ref, ins.mb) for ref in ins.reads]
        if self.weights is not None:  # the loss's own share (aux leaves keep theirs): weight x (m x dp) / (m x dp)
            values[0] = (_as(values[0], totals[0].dtype) * (self.weights[ins.mb] * self.m * self.dp)).to(totals[0].dtype)
        with torch.no_grad():
            for group in self.sum_groups:
                dtype = totals[group[0]].dtype
                shares = torch._foreach_div([_as(values[k], dtype) for k in group], float(self.m * self.dp))
                torch._foreach_add_([totals[k] for k in group], shares)

    def reduce_grads(self, ins: Instr) -> None:
        pids = [int(r[1:]) for r in ins.reads]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for pid in pids:
            if pid not in self.grads and pid not in self.params:
                continue  # an integer leaf the loss never reads: no rank has a grad for it (every rank skips it)
            if pid not in self.grads:
                self.grads[pid] = torch.zeros_like(self.params[pid])
            by_dtype.setdefault(self.grads[pid].dtype, []).append(pid)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors([self.grads[p] for p in group])
            self.transport.all_reduce(flat, ins.group)
            for pid, g in zip(group, _unflatten_dense_tensors(flat, [self.grads[p] for p in group])):
                self.grads[pid] = g

    def reduce_loss(self, ins: Instr) -> None:
        """Every rank gets the loss (and aux leaves) summed over the last stage's ranks; the others hold zeros."""
        self._drain_sends()
        if self.transport.world_size == 1:
            return
        everyone = tuple(range(self.transport.world_size))
        for flat in self.flat_totals:  # one sum per summing dtype, in the same order on every rank, in place
            self.transport.all_reduce(flat, everyone)


class _Pending:
    """A posted receive that one or more refs (a pack's members) wait on: waited on once."""

    __slots__ = ("handle", "done")

    def __init__(self, handle: Any) -> None:
        self.handle, self.done = handle, False

    def wait(self, transport: Transport, ref: str) -> None:
        if not self.done:
            transport.wait(self.handle, f"receiving {ref}")
            self.done = True


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _summed(dtype: torch.dtype) -> torch.dtype:
    """The dtype a loss or aux leaf is summed over microbatches in: float64 stays, the rest sum in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32



def stand_in(aval: ir.AbstractValue, device: torch.device) -> torch.Tensor:
    """Data of the right shape for a warm-up run: small random floats, zeros (valid indices) otherwise."""
    if aval.dtype.is_floating_point:
        return torch.randn(aval.shape, device=device).to(aval.dtype) * 0.01
    return torch.zeros(aval.shape, dtype=aval.dtype, device=device)


HANDLERS: dict[str, Callable[[Executor, Instr], None]] = {
    **{kind: Executor.compute for kind in COMPUTE},
    "comm": Executor.comm, "free": Executor.free, "loss_grad": Executor.loss_grad, "add_loss": Executor.add_loss,
    "reduce_grads": Executor.reduce_grads, "reduce_loss": Executor.reduce_loss,
}


def _contiguous_at(fn: Callable[..., Any], positions: Sequence[int]) -> Callable[..., Any]:
    """`fn` with its arguments at `positions` made contiguous first (inside a captured graph: the copies are
    the graph's own temporaries, in its pool)."""
    def run(*args: Any) -> Any:
        return fn(*[a.contiguous() if k in positions else a for k, a in enumerate(args)])
    return run
