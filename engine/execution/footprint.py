"""Device memory of a rank's program, by replaying it: the bytes held at each instruction, and the peak.

The runtime's allocations are all visible in the program: the rank's parameters and its replica's
microbatches (every batch leaf, held for the whole step), a grad accumulator `g<leaf>` from its first use to
the end, a buffer `b<n>` from the instruction that writes it (a compute, or a receive posted by a comm
group) to its `free` (small received tensors are views of one pack, held until its last member's `free`; a
sent pack is a new buffer during its comm: `packing`), and inside a compute the values its program makes and
frees (`ir.run_bytes`, with fx's frees at last use; or, for a program measured on the device, the bytes it
was seen to make: `engine.execution.profile`). `reduce_grads` flattens its grads into one buffer for
the all-reduce. This is what `torch.cuda.max_memory_allocated` counts for programs run as fx code, short of
the libraries' own workspaces (cuBLAS, attention kernels), the allocator's rounding to 512 bytes, and a sent
buffer (or pack) that its transfer keeps alive past its `free` (or its comm) until the send completes.

With CUDA graphs (`engine.execution.graphs`) the bytes sit elsewhere (`_Graphed`): the computes' values and
temporaries in the graphs' pool, which the capture step fills in program order and which stays reserved; the
rest with the allocator, which also holds for good a clone of every parameter and batch leaf the computes read,
every received value a compute reads (held from the capture step) and the grad accumulators, and at the step's
end the copies of them it hands out. A rank's peak is then the pool's high-water mark plus the allocator's peak.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs

import ir

from ..units import nbytes
from .emit import StageInfo
from .packing import Layouts
from .profile import Key
from .program import COMPUTE, Instr, Program


@attrs.frozen
class Footprint:
    """Bytes of one rank's step: `static` (params, batch, the transport's rings), `peak` (everything, at instruction
    `peak_at`), and `held[i]`, the bytes held after instruction i. With CUDA graphs, `pool` (the graphs' pool's
    high-water mark) and `kept` (what the graphs hold for good besides: clones, held inputs, accumulators) are in
    `peak` and `held`; both are 0 without."""

    rank: int
    static: int
    peak: int
    peak_at: int
    held: tuple[int, ...]
    pool: int = 0
    kept: int = 0

    def __str__(self) -> str:
        graphs = f", graphs' pool {nbytes(self.pool)}, kept {nbytes(self.kept)}" if self.pool or self.kept else ""
        return (f"rank {self.rank}: peak {nbytes(self.peak)} at instruction {self.peak_at} "
                f"(params and batch {nbytes(self.static)}{graphs})")


class _Replay:
    """Walks a program, one small handler per instruction kind, keeping the bytes of each live ref."""

    def __init__(self, infos: Sequence[StageInfo], param_bytes: dict[int, int],
                 measured: Callable[[Key], int | None] = lambda key: None) -> None:
        self.infos, self.param_bytes, self.measured = infos, param_bytes, measured
        self.runs: dict[tuple[int, str, tuple[int, ...]], ir.RunBytes] = {}  # a program's bytes, once
        self.live: dict[str, int] = {}
        self.now = 0  # bytes held beyond the static ones
        self.top = 0  # the most held during the current instruction
        self.layouts = Layouts(infos)  # each transfer's messages, as the runtime posts them
        self.packs: dict[str, set[str]] = {}  # a received pack -> its members not yet freed
        self.owner: dict[str, str] = {}  # a packed ref -> its pack
        self.storage: dict[tuple[int, str], tuple[tuple[int, int] | None, ...]] = {}  # `_stores`, once a program

    def hold(self, ref: str, nbytes: int) -> None:
        if ref not in self.live:
            self.live[ref] = nbytes
            self.now += nbytes

    def compute(self, ins: Instr) -> None:
        info = self.infos[ins.stage]
        part, acc = getattr(info.ad, ins.kind), ins.accumulated()
        for k in acc:  # accumulators are made (zeros) before the program runs
            self.hold(ins.writes[k], self.param_bytes[int(ins.writes[k][1:])])
        self.top = self.now + self._made(ins, part, acc)
        stores = self._stores(ins.stage, ins.kind, part)
        shared: dict[int, list[str]] = {}  # outputs on one storage the program made: held once, as a pack
        for ref, slot, store in zip(ins.writes, part.out_slots, stores):
            if ref[0] != "b" or ref in ins.reads:
                continue
            if store is None:
                self.hold(ref, info.ad.slot_avals[slot].nbytes)
            else:
                shared.setdefault(store[0], []).append(ref)
        for k, refs in shared.items():
            if len(refs) == 1:
                self.hold(refs[0], stores[k][1])  # type: ignore[index]
                continue
            pack = f"store {refs[0]}"
            self.hold(pack, stores[k][1])  # type: ignore[index]
            self.packs[pack] = set(refs)
            self.owner.update((ref, pack) for ref in refs)

    def _stores(self, stage: int, kind: str, part: ir.Part) -> tuple[tuple[int, int] | None, ...]:
        """Per output of a stage's program: (its storage's first output, the storage's bytes), or None
        (`ir.output_storage`)."""
        key = (stage, kind)
        if key not in self.storage:
            self.storage[key] = ir.output_storage(part.graph)
        return self.storage[key]

    def _made(self, ins: Instr, part: ir.Part, acc: tuple[int, ...]) -> int:
        """The bytes a compute's program makes while it runs: as measured on the device, else fx's frees."""
        key = (ins.stage, ins.kind, acc)
        made = self.measured(key)
        if made is None:
            if key not in self.runs:
                self.runs[key] = ir.run_bytes(part.graph, acc)
            made = self.runs[key].peak
        return made

    def comm(self, ins: Instr) -> None:
        sent = 0
        for c in ins.comm:
            lay = self.layouts(c)
            for m in lay.messages:
                if c.op == "send":
                    sent += m.nbytes if m.packed else 0  # a pack is a new buffer; a large tensor goes as it is
                elif m.packed:  # one buffer, alive until the last of its members' views is freed
                    pack = f"pack {c.bufs[m.members[0]]}"
                    self.hold(pack, m.nbytes)
                    self.packs[pack] = {c.bufs[k] for k in m.members}
                    self.owner.update((c.bufs[k], pack) for k in m.members)
                else:
                    self.hold(c.bufs[m.members[0]], m.nbytes)
        self.top = self.now + sent

    def free(self, ins: Instr) -> None:
        for ref in ins.reads:
            self.drop(ref)

    def drop(self, ref: str) -> None:
        pack = self.owner.pop(ref, None)
        if pack is None:
            self.now -= self.live.pop(ref, 0)
            return
        self.packs[pack].discard(ref)
        if not self.packs[pack]:
            del self.packs[pack]
            self.now -= self.live.pop(pack)

    def loss_grad(self, ins: Instr) -> None:
        info = self.infos[ins.stage]
        self.hold(ins.writes[0], info.stage.graph.outputs[info.loss_index].aval.dtype.itemsize)

    def reduce_grads(self, ins: Instr) -> None:
        for ref in ins.reads:
            self.hold(ref, self.param_bytes[int(ref[1:])])
        self.top = self.now + sum(self.param_bytes[int(r[1:])] for r in ins.reads)  # the flat copy

    def nothing(self, ins: Instr) -> None:
        pass


class _Graphed(_Replay):
    """The replay of a step whose computes replay CUDA graphs. `pool_now` / `pool_peak`: the bytes of the
    computes' live values in the graphs' pool and its high-water mark (a compute's temporaries included), outputs
    on one storage (`ir.output_storage`) counted once until the last is freed; a value a send reads as it is (not
    packed) stays to the end of the capture step (no send is retired before it).
    `now` is the allocator's: received buffers and packs as in `_Replay`; `kept`: what it holds for good (clones
    of the parameters and batch leaves the computes read, the received values they read, the accumulators)."""

    def __init__(self, infos: Sequence[StageInfo], param_bytes: dict[int, int], batch_bytes: dict[int, int],
                 measured: Callable[[Key], int | None] = lambda key: None) -> None:
        super().__init__(infos, param_bytes, measured)
        self.batch_bytes = batch_bytes
        self.pooled: dict[str, int] = {}  # a storage a compute made in the pool (named by its first value) -> bytes
        self.pool_of: dict[str, str] = {}  # a compute's value in the pool -> its storage's name in `pooled`
        self.on: dict[str, set[str]] = {}  # a pooled storage -> its values not yet freed (views share one)
        self.inputs_of: dict[tuple[int, str], tuple[int | None, ...]] = {}  # `ir.output_inputs`, once a program
        self.made_by: dict[str, tuple[int, bool]] = {}  # a compute's value -> (its stage, made as a view)
        self.viewed: dict[tuple[int, str], tuple[bool, ...]] = {}  # `ir.output_views`, once a program
        self.sent: set[str] = set()  # pooled values a send reads: held to the capture step's end
        self.pool_now = self.pool_peak = 0
        self.kept: dict[str, int] = {}  # what the graphs' allocator side holds for good, by what it is

    def keep(self, what: str, nbytes: int) -> None:
        self.kept.setdefault(what, nbytes)

    def compute(self, ins: Instr) -> None:
        info = self.infos[ins.stage]
        part, acc = getattr(info.ad, ins.kind), ins.accumulated()
        for k in acc:
            self.keep(ins.writes[k], self.param_bytes[int(ins.writes[k][1:])])
        for ref in ins.reads:
            self._read(ref, ins.mb)
        self.pool_peak = max(self.pool_peak, self.pool_now + self._made(ins, part, acc))
        outputs = zip(ins.writes, part.out_slots, self._stores(ins.stage, ins.kind, part), self._on_inputs(ins, part),
                      self._views(ins.stage, ins.kind, part))
        shared: dict[Any, str] = {}  # a storage this compute made, or its copy of an input -> the first output on it
        for ref, slot, store, (on_input, copy), view in outputs:
            if ref[0] != "b" or ref in ins.reads or ref in self.pool_of:
                continue
            self.made_by[ref] = (ins.stage, view)
            if on_input is not None and not self._handed_over(on_input, ins.stage):
                self._join(ref, on_input)  # a view of an input: its storage, pooled already or kept for good
            elif on_input is not None:  # views of a handed-over input: the graph's one copy of it
                self._pool(ref, shared.setdefault(("copy", on_input), ref), copy)
            elif store is not None:  # views of one value the compute made: its storage, once
                self._pool(ref, shared.setdefault(store[0], ref), store[1])
            else:
                self._pool(ref, ref, info.ad.slot_avals[slot].nbytes)
        self.pool_peak = max(self.pool_peak, self.pool_now)

    def _join(self, ref: str, on_input: str) -> None:
        """`ref` lives on `on_input`'s storage: in its pooled group, if pooled (else kept for good: no bytes)."""
        if on_input in self.pool_of:
            self.pool_of[ref] = self.pool_of[on_input]
            self.on[self.pool_of[ref]].add(ref)

    def _pool(self, ref: str, name: str, nbytes: int) -> None:
        """`ref` lives on the pooled storage `name`: a new one of `nbytes` where `name` is `ref` itself."""
        if name == ref:
            self.pooled[ref] = nbytes
            self.on[ref] = set()
            self.pool_now += nbytes
        self.pool_of[ref] = name
        self.on[name].add(ref)

    def _handed_over(self, ref: str, stage: int) -> bool:
        """`ref` is another stage's value on this rank (zbv's turn of the V) that its program made as a view (a
        transpose, say): it may come not contiguous, and then the graph reading it copies it (`Executor.compute`),
        so views of it live on that copy, a storage of the input's size. Not modelled (the ir has no strides): a
        view that comes contiguous all the same (counted as a copy), an allocated value that keeps a transposed
        input's strides (counted as no copy); a review measured both at 0 at the planner's cuts of the GPT and the
        Llama (at cuts inside a block, up to 3.5 % of a toy model's pool)."""
        made_by = self.made_by.get(ref)
        return made_by is not None and made_by[0] != stage and made_by[1]

    def _views(self, stage: int, kind: str, part: ir.Part) -> tuple[bool, ...]:
        if (stage, kind) not in self.viewed:
            self.viewed[stage, kind] = ir.output_views(part.graph)
        return self.viewed[stage, kind]

    def _on_inputs(self, ins: Instr, part: ir.Part) -> list[tuple[str | None, int]]:
        """Per output of the compute: the ref of the input whose storage it lives on (`ir.output_inputs`) and that
        input's bytes (what a contiguous copy of it holds), or (None, 0)."""
        key = (ins.stage, ins.kind)
        if key not in self.inputs_of:
            self.inputs_of[key] = ir.output_inputs(part.graph)
        avals = self.infos[ins.stage].ad.slot_avals
        return [(None, 0) if k is None else (ins.reads[k], avals[part.in_slots[k]].nbytes)
                for k in self.inputs_of[key]]

    def _read(self, ref: str, mb: int) -> None:
        """What reading `ref` makes the graphs hold: a clone of a parameter (once) or of a microbatch's batch
        leaf, or the received buffer (its whole pack) itself."""
        if ref[0] == "p":
            self.keep(ref, self.param_bytes[int(ref[1:])])
        elif ref[0] == "x":
            self.keep(f"{ref}@{mb}", self.batch_bytes[int(ref[1:])])
        elif ref[0] == "b" and ref not in self.pool_of:
            pack = self.owner.get(ref, ref)
            self.keep(pack, self.live.get(pack, 0))

    def comm(self, ins: Instr) -> None:
        super().comm(ins)
        self.sent.update(c.bufs[m.members[0]] for c in ins.comm if c.op == "send" for m in self.layouts(c).messages
                         if not m.packed and c.bufs[m.members[0]] in self.pool_of)  # a pack is a copy

    def free(self, ins: Instr) -> None:
        for ref in ins.reads:
            if ref not in self.pool_of:
                self.drop(ref)
            elif ref not in self.sent:  # a sent value keeps its storage to the step's end
                name = self.pool_of.pop(ref)
                self.on[name].discard(ref)
                if not self.on[name]:
                    del self.on[name]
                    self.pool_now -= self.pooled.pop(name)

    def reduce_grads(self, ins: Instr) -> None:
        self.top = self.now + sum(self.param_bytes[int(r[1:])] for r in ins.reads)  # the flat copy

    def handed_out(self) -> int:
        """The copies of the accumulators the step hands out at its end."""
        return sum(n for what, n in self.kept.items() if what[0] == "g")


HANDLERS: dict[str, str] = {  # an instruction's kind -> the replay's method for it (a subclass may override it)
    **{kind: "compute" for kind in COMPUTE},
    "comm": "comm", "free": "free", "loss_grad": "loss_grad", "reduce_grads": "reduce_grads",
    "add_loss": "nothing", "reduce_loss": "nothing",
}


def footprint(program: Program, infos: Sequence[StageInfo], graph: ir.Graph, *, microbatches: int,
              measured: Callable[[Key], int | None] = lambda key: None, resident: int = 0,
              graphs: bool = False) -> Footprint:
    """The replayed bytes of `program` (a rank of a plan whose stages are `infos`, cut from `graph`);
    `measured(key)`: the bytes a compute's program was seen to make (`engine.execution.profile`), where
    known, instead of fx's frees; `resident`: bytes held all along besides params and batch (the transport's
    copy-engine rings), counted as static; `graphs`: the computes replay CUDA graphs (`_Graphed`)."""
    if graphs:
        return _graphed_footprint(program, infos, graph, microbatches=microbatches, measured=measured,
                                  resident=resident)
    param_bytes, static = _static(program, infos, graph, microbatches, resident)
    held, peak, peak_at = _walk(_Replay(infos, param_bytes, measured), program, static)
    return Footprint(program.rank, static, static + peak, peak_at, tuple(held))


def _walk(replay: _Replay, program: Program, base: int) -> tuple[list[int], int, int]:
    """Replay `program`: (the bytes held after each instruction, `base` included; the most held beyond `base`
    at any point; the instruction where)."""
    held, peak, peak_at = [], 0, 0
    for i, ins in enumerate(program.instrs):
        replay.top = 0
        getattr(replay, HANDLERS[ins.kind])(ins)
        top = max(replay.top, replay.now)
        if top > peak:
            peak, peak_at = top, i
        held.append(base + replay.now)
    return held, peak, peak_at


def _static(program: Program, infos: Sequence[StageInfo], graph: ir.Graph, microbatches: int,
            resident: int) -> tuple[dict[int, int], int]:
    """(each parameter's bytes, the bytes a rank holds all step: its params, its microbatches, `resident`)."""
    param_bytes = {i: graph.inputs[i].aval.nbytes for i in range(graph.num_params)}
    mine = {ins.stage for ins in program.instrs if ins.stage >= 0}
    params = sorted({pid for s in mine for pid in infos[s].stage.param_ids})
    batch = sum(v.aval.nbytes for v in graph.batch)  # every rank gets every leaf of its replica's microbatches
    return param_bytes, sum(param_bytes[p] for p in params) + microbatches * batch + resident


def _graphed_footprint(program: Program, infos: Sequence[StageInfo], graph: ir.Graph, *, microbatches: int,
                       measured: Callable[[Key], int | None], resident: int) -> Footprint:
    """`footprint` of a step that replays CUDA graphs: the pool's high-water mark (reserved all step) plus the
    allocator's peak, whose static part now has what the graphs keep (`_Graphed`). Two walks: the first finds
    what is kept and the pool's mark, the second the allocator's bytes with all of it held from the start."""
    param_bytes, static = _static(program, infos, graph, microbatches, resident)
    batch_bytes = {i: v.aval.nbytes for i, v in enumerate(graph.inputs)}  # a batch leaf's: one microbatch's
    first = _Graphed(infos, param_bytes, batch_bytes, measured)
    for ins in program.instrs:
        getattr(first, HANDLERS[ins.kind])(ins)
    base = static + sum(first.kept.values()) + first.pool_peak
    replay = _Graphed(infos, param_bytes, batch_bytes, measured)
    held, peak, peak_at = _walk(replay, program, base)
    if replay.now + first.handed_out() > peak:
        peak, peak_at = replay.now + first.handed_out(), len(program.instrs) - 1
    return Footprint(program.rank, static, base + peak, peak_at, tuple(held), first.pool_peak, sum(first.kept.values()))
