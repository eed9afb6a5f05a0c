"""The runtime: executes one rank's static Program, one small handler per instruction kind."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import ir

from .emit import StageInfo
from .instructions import Instr, Program
from .transport import Transport

Hook = Callable[["Executor", Instr], None]


class Executor:
    """Runs a Program over a Transport for one step: buffers live in a dict and die at `free`."""

    def __init__(self, program: Program, infos: Sequence[StageInfo], transport: Transport, *,
                 microbatches: int, dp: int, device: torch.device, hook: Hook | None = None) -> None:
        self.program, self.infos, self.transport = program, infos, transport
        self.m, self.dp, self.device, self.hook = microbatches, dp, device, hook
        self.parts: dict[tuple[int, str], Callable[..., Any]] = {}
        self.loss_dtype = infos[-1].stage.graph.outputs[-1].aval.dtype

    # -- one step -------------------------------------------------------------------------------
    def run(self, params: dict[int, torch.Tensor], microbatches: Sequence[dict[int, torch.Tensor]]
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        self.params, self.mbs = params, microbatches
        self.bufs: dict[str, torch.Tensor] = {}
        self.pending: dict[str, Any] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.grads: dict[int, torch.Tensor] = {}
        self.loss = torch.zeros((), dtype=torch.float64 if self.loss_dtype == torch.float64 else torch.float32,
                                device=self.device)
        for ins in self.program.instrs:
            if self.hook is not None:
                self.hook(self, ins)
            HANDLERS[ins.kind](self, ins)
        self._drain_sends()
        return self.loss, self.grads

    # -- operands -------------------------------------------------------------------------------
    def read(self, ref: str, mb: int) -> torch.Tensor:
        kind, idx = ref[0], int(ref[1:])
        if kind == "p":
            return self.params[idx]
        if kind == "x":
            return self.mbs[mb][idx]
        if ref in self.pending:
            self.transport.wait(self.pending.pop(ref), f"receiving {ref}")
        return self.bufs[ref]

    def write(self, ref: str, value: torch.Tensor) -> None:
        if ref[0] == "g":
            pid = int(ref[1:])
            self.grads[pid] = value if pid not in self.grads else self.grads[pid] + value
        else:
            self.bufs[ref] = value

    def _drain_sends(self) -> None:
        for work, _ in self.sends:
            self.transport.wait(work, "sending")
        self.sends = []

    # -- handlers -------------------------------------------------------------------------------
    def compute(self, ins: Instr) -> None:
        key = (ins.stage, ins.kind)
        if key not in self.parts:
            self.parts[key] = ir.compile_graph(getattr(self.infos[ins.stage].ad, ins.kind).graph)
        outs = self.parts[key](*[self.read(r, ins.mb) for r in ins.reads])
        for ref, value in zip(ins.writes, outs):
            self.write(ref, value)

    def comm(self, ins: Instr) -> None:
        self._drain_sends()  # the previous group's sends finish before a new group starts
        ops, recvs = [], []
        for c in ins.comm:
            info = self.infos[c.stage]
            for k, ref in enumerate(c.bufs):
                if c.op == "send":
                    ops.append(("send", c.peer, self.read(ref, c.mb).contiguous()))
                else:
                    aval = _recv_aval(info, c.what, k)
                    t = torch.empty(aval.shape, dtype=aval.dtype, device=self.device)
                    self.bufs[ref] = t
                    ops.append(("recv", c.peer, t))
                    recvs.append(ref)
        handles = self.transport.post(ops)
        rx = iter(recvs)
        for (op, _, t), h in zip(ops, handles):
            if op == "send":
                self.sends.append((h, t))
            else:
                self.pending[next(rx)] = h

    def free(self, ins: Instr) -> None:
        for ref in ins.reads:
            self.bufs.pop(ref, None)

    def loss_grad(self, ins: Instr) -> None:
        self.bufs[ins.writes[0]] = torch.full((), 1.0 / (self.m * self.dp), dtype=self.loss_dtype, device=self.device)

    def add_loss(self, ins: Instr) -> None:
        self.loss += self.read(ins.reads[0], ins.mb).detach().to(self.loss.dtype) / (self.m * self.dp)

    def reduce_grads(self, ins: Instr) -> None:
        pids = [int(r[1:]) for r in ins.reads]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for pid in pids:
            if pid not in self.grads:
                self.grads[pid] = torch.zeros_like(self.params[pid])
            by_dtype.setdefault(self.grads[pid].dtype, []).append(pid)
        for group in by_dtype.values():
            flat = _flatten_dense_tensors([self.grads[p] for p in group])
            self.transport.all_reduce(flat, ins.group)
            for pid, g in zip(group, _unflatten_dense_tensors(flat, [self.grads[p] for p in group])):
                self.grads[pid] = g

    def reduce_loss(self, ins: Instr) -> None:
        self._drain_sends()
        if self.transport.world_size > 1:
            self.transport.all_reduce(self.loss, tuple(range(self.transport.world_size)))


def _recv_aval(info: StageInfo, what: str, k: int) -> ir.AbstractValue:
    g = info.stage.graph
    if what == "act":
        return g.inputs[info.act_slot(k)].aval
    return g.outputs[info.ct_outs()[k]].aval


HANDLERS: dict[str, Callable[[Executor, Instr], None]] = {
    "forward": Executor.compute, "backward_input": Executor.compute, "backward_weight": Executor.compute,
    "comm": Executor.comm, "free": Executor.free, "loss_grad": Executor.loss_grad, "add_loss": Executor.add_loss,
    "reduce_grads": Executor.reduce_grads, "reduce_loss": Executor.reduce_loss,
}
