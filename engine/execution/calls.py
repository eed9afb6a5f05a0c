"""A compute instruction prepared once per Executor: where each operand comes from, in argument order.

An instruction's operands are refs (`p3`, `x0`, `b12`, and `g3` for the accumulators it adds into).
Parsing them at every call cost the host about 1 us an operand, and a stage of a BatchNorm ResNet reads
600+ parameters and buffers per microbatch: several ms of host time a microbatch, which the GPU waits for
where a program's tail is launch-bound (issue #24). Prepared, a call copies its parameters' list (the same
for every microbatch of a step) and fills in the few operands that change.
"""
from __future__ import annotations

from typing import Sequence

import attrs

from ..planning.artifacts import StageInfo
from .program import COMPUTE, Instr, Program


@attrs.frozen
class Call:
    """One compute instruction's operands by source, each as (argument position, leaf or ref)."""

    stage: int
    kind: str
    mb: int
    size: int                                   # arguments before the accumulators
    params: tuple[tuple[int, int], ...]         # parameter leaves: the same tensors all step
    batch: tuple[tuple[int, int], ...]          # leaves of the microbatch
    buffers: tuple[tuple[int, str], ...]        # values made or received this step
    contiguous: frozenset[int]                  # positions traced as contiguous placeholders (stage inputs, cotangents)
    accumulate: tuple[int, ...]                 # output positions that add into grad accumulators
    grads: tuple[int, ...]                      # their leaves, in that order
    writes: tuple[tuple[int, str], ...]         # (output position, buffer ref) of the values it makes
    group: int                                  # calls with the same `size` and `params` share one list a step

    def __str__(self) -> str:
        return (f"{self.kind} s{self.stage} mb{self.mb}: {len(self.params)} params, {len(self.batch)} batch, "
                f"{len(self.buffers)} buffers -> {len(self.writes)} values, {len(self.grads)} grads")


Groups = dict[tuple[int, tuple[tuple[int, int], ...]], int]  # (size, parameter operands) -> its Call.group


def prepare(program: Program, infos: Sequence[StageInfo], groups: Groups) -> dict[int, Call]:
    """Every compute instruction of `program`, keyed by `id(instr)` (unique while the Executor
    holds the program);
    `groups` numbers the distinct parameter lists, shared by every call prepared for one Executor."""
    return {id(ins): _prepare(ins, infos[ins.stage], groups) for ins in program.instrs if ins.kind in COMPUTE}


def _prepare(ins: Instr, info: StageInfo, groups: Groups) -> Call:
    ad = info.ad
    edge = len(ad.grad_slots) + sum(c is not None for c in ad.ct_slots)  # inputs, then cotangents
    slots = getattr(ad, ins.kind).in_slots
    params, batch, buffers = [], [], []
    for pos, ref in enumerate(ins.reads):
        source = {"p": params, "x": batch}.get(ref[0], buffers)
        source.append((pos, int(ref[1:]) if ref[0] in "px" else ref))
    acc = ins.accumulated()
    key = (len(ins.reads), tuple(params))
    return Call(stage=ins.stage, kind=ins.kind, mb=ins.mb, size=len(ins.reads), params=key[1], batch=tuple(batch),
                buffers=tuple(buffers), contiguous=frozenset(k for k, s in enumerate(slots) if s < edge),
                accumulate=acc, grads=tuple(int(ins.writes[k][1:]) for k in acc),
                writes=tuple((k, ref) for k, ref in enumerate(ins.writes) if ref[0] != "g"),
                group=groups.setdefault(key, len(groups)))
