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
"""
from __future__ import annotations

from typing import Callable, Sequence

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
    `peak_at`), and `held[i]`, the bytes held after instruction i."""

    rank: int
    static: int
    peak: int
    peak_at: int
    held: tuple[int, ...]

    def __str__(self) -> str:
        return (f"rank {self.rank}: peak {nbytes(self.peak)} at instruction {self.peak_at} "
                f"(params and batch {nbytes(self.static)})")


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

    def hold(self, ref: str, nbytes: int) -> None:
        if ref not in self.live:
            self.live[ref] = nbytes
            self.now += nbytes

    def compute(self, ins: Instr) -> None:
        info = self.infos[ins.stage]
        part, acc = getattr(info.ad, ins.kind), ins.accumulated()
        for k in acc:  # accumulators are made (zeros) before the program runs
            self.hold(ins.writes[k], self.param_bytes[int(ins.writes[k][1:])])
        key = (ins.stage, ins.kind, acc)
        made = self.measured(key)
        if made is None:
            if key not in self.runs:
                self.runs[key] = ir.run_bytes(part.graph, acc)
            made = self.runs[key].peak
        self.top = self.now + made
        for ref, slot in zip(ins.writes, part.out_slots):
            if ref[0] == "b" and ref not in ins.reads:
                self.hold(ref, info.ad.slot_avals[slot].nbytes)

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
            pack = self.owner.pop(ref, None)
            if pack is None:
                self.now -= self.live.pop(ref, 0)
                continue
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


HANDLERS: dict[str, Callable[[_Replay, Instr], None]] = {
    **{kind: _Replay.compute for kind in COMPUTE},
    "comm": _Replay.comm, "free": _Replay.free, "loss_grad": _Replay.loss_grad,
    "reduce_grads": _Replay.reduce_grads, "add_loss": _Replay.nothing, "reduce_loss": _Replay.nothing,
}


def footprint(program: Program, infos: Sequence[StageInfo], graph: ir.Graph, *, microbatches: int,
              measured: Callable[[Key], int | None] = lambda key: None, resident: int = 0) -> Footprint:
    """The replayed bytes of `program` (a rank of a plan whose stages are `infos`, cut from `graph`);
    `measured(key)`: the bytes a compute's program was seen to make (`engine.execution.profile`), where
    known, instead of fx's frees; `resident`: bytes held all along besides params and batch (the transport's
    copy-engine rings), counted as static."""
    param_bytes = {i: graph.inputs[i].aval.nbytes for i in range(graph.num_params)}
    mine = {ins.stage for ins in program.instrs if ins.stage >= 0}
    params = sorted({pid for s in mine for pid in infos[s].stage.param_ids})
    batch = sum(v.aval.nbytes for v in graph.batch)  # every rank gets every leaf of its replica's microbatches
    static = sum(param_bytes[p] for p in params) + microbatches * batch + resident
    replay = _Replay(infos, param_bytes, measured)
    held, peak, peak_at = [], 0, 0
    for i, ins in enumerate(program.instrs):
        replay.top = 0
        HANDLERS[ins.kind](replay, ins)
        top = max(replay.top, replay.now)
        if top > peak:
            peak, peak_at = top, i
        held.append(static + replay.now)
    return Footprint(program.rank, static, static + peak, peak_at, tuple(held))
