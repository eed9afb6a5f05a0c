"""Assembly: a Planned (plan, graph, stage programs, lowered table) becomes one world rank's Program.

This is the only place that turns a plan into something runnable. `engine.parallelize`, the
in-process runner (`execution.inprocess`), `engine.testing` and `benchmarks/gpu_pipeline.py` all call
`assemble`, so what the harness checks is what a job runs. A rank emits only its own program: what it
needs to know of the others (which ranks it exchanges tensors with, which ranks sum each grad) comes
from the lowered table, which every rank holds alike.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from ir.device import rank_neutral

from ..planning.artifacts import Planned
from ..planning.plan import fingerprint
from ..version import fnpipe_version
from . import routing
from .emit import emit
from .program import Program


def assemble(planned: Planned, rank: int) -> Program:
    """The program of world rank `rank` (its dp replica, pipeline position and replica: `routing.place`)."""
    if not 0 <= rank < planned.plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's world of {planned.plan.world_size} ranks")
    return emit(planned.stages, planned.table, world_rank=rank, plan=planned.plan, num_params=planned.num_params)


def channels(planned: Planned) -> list[tuple[int, int]]:
    """Every ordered (sender, receiver) pair of world ranks that exchange tensors, read off the table."""
    return routing.channels(planned.plan, planned.table)


def reduce_groups(planned: Planned) -> list[tuple[int, ...]]:
    """The world ranks that sum a grad leaf together (tied leaves across stages, replicas of a stage, dp); with
    ZeRO-1 also each pipeline position's dp group, which the sharded optimizer reduce-scatters over."""
    plan = planned.plan
    groups = list(routing.grad_groups(plan, planned.stages, planned.table, planned.num_params))
    if plan.shard_optimizer and plan.dp > 1:  # equal replicas only (Plan refuses ZeRO-1 with unequal ones)
        p = plan.pipeline_depth
        groups += [tuple(d * p + q for d in range(plan.dp)) for q in range(p)]
    return groups


def common_fingerprints(planned: Planned) -> dict[str, str]:
    """What every rank must hold alike before the first step, part by part, so that a refusal names the part:
    fnpipe's version, each field of the plan (`plan.stages`, `plan.predicted_step_time`, ...), the graph
    (device indices left out: see `rank_neutral`) with its input names, and the lowered table."""
    graph = [rank_neutral(str(planned.graph)), list(planned.graph.input_names)]
    plan = {f"plan.{key}": value for key, value in json.loads(planned.plan.to_json()).items()}
    parts = {"fnpipe version": fnpipe_version(), **plan, "traced graph": graph, "schedule table": str(planned.table)}
    return {name: fingerprint(value) for name, value in parts.items()}


def interface(program: Program, world_size: int) -> dict[str, str]:
    """What the other ranks rely on in `program`, digested: per channel the ordered transfers it sends or
    receives (`send a>b`, `recv a>b`), and per group the ordered collectives it joins (`sum 0,1`). Rank a's
    `send a>b` must equal rank b's `recv a>b`, and every member of a group must join its collectives alike;
    each rank emits only its own program, so this is how ranks check each other's."""
    parts: dict[str, list[str]] = {}
    everyone = tuple(range(world_size))
    for ins in program.instrs:
        for c in ins.comm:
            a, b = (program.rank, c.peer) if c.op == "send" else (c.peer, program.rank)
            sender = c.stage if c.op == "send" else c.stage + _SENDER[c.what]  # both ends name the sending stage
            parts.setdefault(f"{c.op} {a}>{b}", []).append(f"{c.what} s{sender} mb{c.mb} n{len(c.bufs)}")
        if ins.kind in _COLLECTIVES:
            group = ins.group or everyone
            parts.setdefault("sum " + ",".join(map(str, group)), []).append(_COLLECTIVES[ins.kind](ins))
    return {key: fingerprint(items) for key, items in parts.items()}


_SENDER = {"act": -1, "grad": 1}  # a receive of stage s's input comes from s - 1, of its output grads from s + 1
_COLLECTIVES = {"reduce_grads": lambda ins: f"grads {len(ins.reads)}", "reduce_loss": lambda ins: "loss"}


def disagreements(interfaces: Sequence[dict[str, str]]) -> list[str]:
    """Where the ranks' programs do not fit together: each channel's two ends, each group's members."""
    out = []
    for a, mine in enumerate(interfaces):
        for key, digest in sorted(mine.items()):
            op, _, who = key.partition(" ")
            if op == "send":
                b = int(who.split(">")[1])
                if interfaces[b].get(f"recv {who}") != digest:
                    out.append(f"rank {a} sends {who} what rank {b} does not receive")
            elif op == "recv":
                src = int(who.split(">")[0])
                if f"send {who}" not in interfaces[src]:
                    out.append(f"rank {a} receives {who} what rank {src} never sends")
            elif op == "sum":
                members = [int(r) for r in who.split(",")]
                alike: dict[str | None, list[int]] = {}
                for r in members:
                    alike.setdefault(interfaces[r].get(key), []).append(r)
                if len(alike) > 1:
                    sides = " and ".join(str(rs) for rs in sorted(alike.values()))
                    out.append(f"ranks {sides} join the sums of group {members} differently")
    return sorted(set(out))


class Programs:
    """Every rank's program, each assembled on first use (a rank needs only its own; reports ask for all)."""

    def __init__(self, planned: Planned, known: dict[int, Program] | None = None,
                 make: Callable[[Planned, int], Program] = assemble) -> None:
        self.planned, self.make = planned, make
        self._made: dict[int, Program] = dict(known or {})

    def __getitem__(self, rank: int) -> Program:
        if rank not in self._made:
            self._made[rank] = self.make(self.planned, rank)
        return self._made[rank]

    def __len__(self) -> int:
        return self.planned.plan.world_size

    def __iter__(self) -> Any:
        return (self[r] for r in range(len(self)))

    def all(self) -> Sequence[Program]:
        return [self[r] for r in range(len(self))]
