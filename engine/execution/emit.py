"""The emitter: a lowered schedule table and the stage programs -> the static Program of one world rank
(which position, microbatches and peers that rank has: `routing`)."""
from __future__ import annotations

from typing import Sequence

import ir
import schedules

from ..planning.artifacts import StageInfo
from ..planning.plan import Plan
from . import routing
from .program import CommOp, Instr, Program


class _Emitter:
    """Walks one rank's lowered actions, naming buffers and tracking which ref holds each slot."""

    def __init__(self, infos: Sequence[StageInfo], table: schedules.Table, rank: int, world_of) -> None:
        self.infos, self.table, self.rank, self.world_of = infos, table, rank, world_of
        self.slots: dict[tuple[int, int], dict[int, str]] = {}
        self.acts: dict[tuple[int, int], list[str]] = {}
        self.cts: dict[tuple[int, int], list[str]] = {}
        self.out: list[Instr] = []
        self.comm: list[CommOp] = []
        self.next_buf = 0
        self.grad_refs: dict[int, dict[int, str]] = {}

    def buf(self) -> str:
        self.next_buf += 1
        return f"b{self.next_buf - 1}"

    def env(self, s: int, mb: int) -> dict[int, str]:
        if (s, mb) not in self.slots:
            info = self.infos[s]
            env = {i: f"p{pid}" for i, pid in enumerate(info.stage.param_ids)}
            env.update({info.n_params + i: f"x{bid}" for i, bid in enumerate(info.stage.batch_ids)})
            self.slots[(s, mb)] = env
        return self.slots[(s, mb)]

    def flush(self) -> None:
        if self.comm:
            self.out.append(Instr("comm", comm=tuple(self.comm)))
            self.comm = []

    def compute(self, kind: str, part: ir.Part, s: int, mb: int, outs: dict[int, str] | None = None) -> None:
        if not part.graph.eqns and not part.out_slots:
            return
        self.flush()
        env = self.env(s, mb)
        reads = tuple(env[i] for i in part.in_slots)
        writes = []
        for slot in part.out_slots:
            if slot not in env or slot in (outs or {}):  # an output that is an input keeps its ref
                env[slot] = (outs or {}).get(slot) or self.buf()
            writes.append(env[slot])
        self.out.append(Instr(kind, s, mb, reads, tuple(writes)))

    def forward(self, s: int, mb: int) -> None:
        info, env = self.infos[s], self.env(s, mb)
        for k, ref in enumerate(self.acts.pop((s, mb), [])):
            env[info.act_slot(k)] = ref
        self.compute("forward", info.ad.forward, s, mb)
        outs = [env[info.ad.out_slots[j]] for j in range(len(info.stage.acts_out))]
        if s + 1 < len(self.infos) and self.table.rank_of(s + 1) == self.rank:
            self.acts[(s + 1, mb)] = outs
        if info.stage.is_last:  # the loss, then the loss function's aux leaves (has_aux)
            reads = [env[info.ad.out_slots[j]] for j in (info.loss_index, *info.aux_indices())]
            self.out.append(Instr("add_loss", s, mb, tuple(reads)))

    def backward_input(self, s: int, mb: int) -> None:
        self._backward("backward_input", self.infos[s].ad.backward_input, s, mb)

    def backward_weight(self, s: int, mb: int) -> None:
        self.compute("backward_weight", self.infos[s].ad.backward_weight, s, mb, self._grad_refs(s))

    def backward(self, s: int, mb: int) -> None:
        """B and W back to back (BW): one fused program, so what B hands W is never held for the whole stage."""
        self._backward("backward", self.infos[s].ad.backward, s, mb, self._grad_refs(s))

    def _grad_refs(self, s: int) -> dict[int, str]:
        """Param grad slots -> the accumulated grads `g<leaf>` they add into (per stage, made once)."""
        if s not in self.grad_refs:
            info = self.infos[s]
            self.grad_refs[s] = {info.ad.grad_slots[i]: f"g{pid}" for i, pid in enumerate(info.stage.param_ids)
                                 if info.ad.grad_slots[i] is not None}
        return self.grad_refs[s]

    def _backward(self, kind: str, part: ir.Part, s: int, mb: int, outs: dict[int, str] | None = None) -> None:
        """Seed the loss grad (last stage) or take the cotangents, run `part`, hand input grads on."""
        info, env = self.infos[s], self.env(s, mb)
        if info.stage.is_last:
            self.flush()
            seed = self.buf()
            env[info.ad.ct_slots[info.loss_index]] = seed
            self.out.append(Instr("loss_grad", s, mb, (), (seed,)))
        for j, ref in zip(info.ct_outs(), self.cts.pop((s, mb), [])):
            env[info.ad.ct_slots[j]] = ref
        self.compute(kind, part, s, mb, outs)
        grads = [env[info.ad.grad_slots[info.act_slot(k)]] for k in info.grad_acts()]
        if s > 0 and self.table.rank_of(s - 1) == self.rank:
            self.cts[(s - 1, mb)] = grads

    def send_f(self, s: int, mb: int) -> None:
        env, info = self.env(s, mb), self.infos[s]
        bufs = tuple(env[info.ad.out_slots[j]] for j in range(len(info.stage.acts_out)))
        self.comm.append(CommOp("send", "act", s, mb, self.world_of(self.table.rank_of(s + 1), mb), bufs))

    def recv_f(self, s: int, mb: int) -> None:
        bufs = [self.buf() for _ in self.infos[s].stage.acts_in]
        self.acts[(s, mb)] = bufs
        self.comm.append(CommOp("recv", "act", s, mb, self.world_of(self.table.rank_of(s - 1), mb), tuple(bufs)))

    def send_b(self, s: int, mb: int) -> None:
        env, info = self.env(s, mb), self.infos[s]
        bufs = tuple(env[info.ad.grad_slots[info.act_slot(k)]] for k in info.grad_acts())
        self.comm.append(CommOp("send", "grad", s, mb, self.world_of(self.table.rank_of(s - 1), mb), bufs))

    def recv_b(self, s: int, mb: int) -> None:
        bufs = [self.buf() for _ in self.infos[s].ct_outs()]
        self.cts[(s, mb)] = bufs
        self.comm.append(CommOp("recv", "grad", s, mb, self.world_of(self.table.rank_of(s + 1), mb), tuple(bufs)))


ACTIONS = {
    "F": _Emitter.forward, "B": _Emitter.backward_input, "W": _Emitter.backward_weight, "BW": _Emitter.backward,
    "SEND_F": _Emitter.send_f, "RECV_F": _Emitter.recv_f, "SEND_B": _Emitter.send_b, "RECV_B": _Emitter.recv_b,
}


def _reads(ins: Instr) -> tuple[str, ...]:
    if ins.kind == "comm":
        return tuple(b for c in ins.comm if c.op == "send" for b in c.bufs)
    return ins.reads


def _writes(ins: Instr) -> tuple[str, ...]:
    if ins.kind == "comm":
        return tuple(b for c in ins.comm if c.op == "recv" for b in c.bufs)
    return ins.writes


def insert_frees(instrs: Sequence[Instr]) -> tuple[Instr, ...]:
    """Add a `free` after the last instruction that touches each buffer (`b*` refs only)."""
    last: dict[str, int] = {}
    for i, ins in enumerate(instrs):
        for ref in (*_writes(ins), *_reads(ins)):
            if ref.startswith("b"):
                last[ref] = i
    dying: dict[int, list[str]] = {}
    for ref, i in last.items():
        dying.setdefault(i, []).append(ref)
    out: list[Instr] = []
    for i, ins in enumerate(instrs):
        out.append(ins)
        if i in dying:
            out.append(Instr("free", reads=tuple(sorted(dying[i], key=lambda r: int(r[1:])))))
    return tuple(out)


def emit(infos: Sequence[StageInfo], lowered: schedules.Table, *, world_rank: int, plan: Plan,
         num_params: int) -> Program:
    """The program of `world_rank`: its position's lowered row, kept where it owns the microbatch, with each
    transfer addressed to the rank that owns the microbatch at the peer position (`routing`)."""
    at = routing.place(plan, world_rank)
    em = _Emitter(infos, lowered, at.position, lambda pos, mb: routing.world_rank(plan, at.dp_replica, pos, mb))
    for action in routing.row(plan, lowered, world_rank):
        ACTIONS[action.kind](em, action.stage, action.microbatch)
    em.flush()
    tail = [Instr("reduce_grads", reads=tuple(f"g{pid}" for pid in pids), group=ranks)
            for ranks, pids in routing.grad_groups(plan, infos, lowered, num_params).items() if world_rank in ranks]
    tail.append(Instr("reduce_loss"))
    return Program(world_rank, insert_frees(em.out) + tuple(tail))
