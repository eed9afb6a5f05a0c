"""TableIndex: a table flattened to integer ids, with each action's data dependencies."""

from __future__ import annotations

from collections.abc import Callable

from schedules.action import (
    BW,
    PARTNER_KIND,
    PEER_OFFSET,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
)
from schedules.table import Table

__all__ = ["NO_BOUNDARY", "TableIndex"]

NO_BOUNDARY = -1  # the dependency is on the same rank (or reached through a receive): no transfer
Key = tuple[int, str, int]  # (stage, kind, microbatch)
Dependency = tuple[int, int]  # (id of the action depended on, boundary stage or NO_BOUNDARY)


class TableIndex:
    """Integer ids for a table's actions (rank by rank), with positions and dependencies.

    Derived, read-only data: built once per validation or simulation, never shared or mutated.
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        self.actions: list[Action] = []
        self.rank: list[int] = []
        self.step: list[int] = []
        self.rows: list[list[int]] = []
        self.id_of: dict[Key, int] = {}
        self.duplicates: list[int] = []
        for rank, row in enumerate(table.rows):
            ids = []
            for step, action in enumerate(row):
                k = len(self.actions)
                key = (action.stage, action.kind, action.microbatch)
                if key in self.id_of:
                    self.duplicates.append(k)
                else:
                    self.id_of[key] = k
                self.actions.append(action)
                self.rank.append(rank)
                self.step.append(step)
                ids.append(k)
            self.rows.append(ids)
        self.lowered = table.is_lowered
        self._dependencies: list[list[Dependency] | None] | None = None

    def find(self, stage: int, kind: str, microbatch: int) -> int | None:
        return self.id_of.get((stage, kind, microbatch))

    def backward(self, stage: int, microbatch: int) -> int | None:
        """Id of the action producing the grad w.r.t. the input of (stage, microbatch)."""
        found = self.id_of.get((stage, BW, microbatch))
        return found if found is not None else self.id_of.get((stage, B, microbatch))

    def crosses(self, stage: int, other: int) -> bool:
        placement = self.table.stage_to_rank
        return placement[stage] != placement[other]

    def dependencies(self, k: int) -> list[Dependency] | None:
        """What action ``k`` waits for; None when a dependency is missing from the table."""
        if self._dependencies is None:
            self._dependencies = [self._find_dependencies(a) for a in self.actions]
        return self._dependencies[k]

    def _find_dependencies(self, action: Action) -> list[Dependency] | None:
        deps = _RULES[action.kind](self, action)
        if any(d is None for d, _ in deps):
            return None
        return [(d, boundary) for d, boundary in deps if d is not None]

    def partner(self, k: int) -> int | None:
        """Id of the matching communication action, or None when the table lacks it."""
        a = self.actions[k]
        return self.id_of.get((a.stage + PEER_OFFSET[a.kind], PARTNER_KIND[a.kind], a.microbatch))


def _upstream(ix: TableIndex, stage: int, kind: str, microbatch: int, other: int,
              receive: str) -> tuple[int | None, int]:
    """Dependency on the neighbouring stage ``other``: through the receive when that is on another
    rank and the table has it (validation makes lowered tables have it all), else on the producer
    plus the transfer."""
    if not ix.crosses(stage, other):
        return _produced(ix, other, kind, microbatch), NO_BOUNDARY
    received = ix.find(stage, receive, microbatch)
    if received is not None:
        return received, NO_BOUNDARY
    return _produced(ix, other, kind, microbatch), min(stage, other)


def _produced(ix: TableIndex, stage: int, kind: str, microbatch: int) -> int | None:
    return ix.find(stage, F, microbatch) if kind == F else ix.backward(stage, microbatch)


def _forward(ix: TableIndex, a: Action) -> list[tuple[int | None, int]]:
    if a.stage == 0:
        return []
    return [_upstream(ix, a.stage, F, a.microbatch, a.stage - 1, RECV_F)]


def _backward(ix: TableIndex, a: Action) -> list[tuple[int | None, int]]:
    deps = [(ix.find(a.stage, F, a.microbatch), NO_BOUNDARY)]
    if a.stage < ix.table.num_stages - 1:
        deps.append(_upstream(ix, a.stage, B, a.microbatch, a.stage + 1, RECV_B))
    return deps


def _weight(ix: TableIndex, a: Action) -> list[tuple[int | None, int]]:
    return [(ix.find(a.stage, B, a.microbatch), NO_BOUNDARY)]


def _send(ix: TableIndex, a: Action) -> list[tuple[int | None, int]]:
    return [(_produced(ix, a.stage, F if a.kind == SEND_F else B, a.microbatch), NO_BOUNDARY)]


def _receive(ix: TableIndex, a: Action) -> list[tuple[int | None, int]]:
    return []


_RULES: dict[str, Callable[[TableIndex, Action], list[tuple[int | None, int]]]] = {
    F: _forward, B: _backward, BW: _backward, W: _weight,
    SEND_F: _send, SEND_B: _send, RECV_F: _receive, RECV_B: _receive,
}
