"""TableIndex: a table flattened to integer ids, with each action's data dependencies."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import chain, repeat
from operator import attrgetter

from schedules.action import (
    BW,
    KINDS,
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
_KIND_CODE = {kind: n for n, kind in enumerate(KINDS)}
_STAGE, _MICROBATCH = attrgetter("stage"), attrgetter("microbatch")


class TableIndex:
    """Integer ids for a table's actions (rank by rank), with positions and dependencies.

    Derived, read-only data: built once per validation or simulation, never shared or mutated.
    ``dense`` holds the id of every (stage, kind, microbatch) at ``code``, -1 where the table
    lacks it, so that a stage's actions of one kind are one slice (``ids``); it is None when
    some action repeats or lies out of range (the table is invalid; ``id_of`` still works).
    """

    def __init__(self, table: Table) -> None:
        self.table = table
        rows = table.rows
        self.actions: list[Action] = list(chain.from_iterable(rows))
        self.rank: list[int] = list(chain.from_iterable(repeat(r, len(row))
                                                        for r, row in enumerate(rows)))
        self.step: list[int] = list(chain.from_iterable(map(range, map(len, rows))))
        self.rows: list[list[int]] = []
        first = 0
        for row in rows:
            self.rows.append(list(range(first, first + len(row))))
            first += len(row)
        self.lowered = table.is_lowered
        self.dense = _dense(self.actions, table.num_stages, table.num_microbatches)
        self._id_of: dict[Key, int] | None = None
        self._dependencies: list[list[Dependency] | None] | None = None
        self._partners: list[int] | None = None

    @property
    def id_of(self) -> dict[Key, int]:
        """(stage, kind, microbatch) -> id of the first action with it."""
        if self._id_of is None:
            keys = [(a.stage, a.kind, a.microbatch) for a in self.actions]
            self._id_of = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))
        return self._id_of

    @property
    def duplicates(self) -> list[int]:
        """Ids of the actions that repeat an earlier one."""
        if self.dense is not None:
            return []
        first = self.id_of
        return [k for k, a in enumerate(self.actions)
                if first[(a.stage, a.kind, a.microbatch)] != k]

    def code(self, stage: int, kind: str, microbatch: int = 0) -> int:
        return (stage * len(KINDS) + _KIND_CODE[kind]) * self.table.num_microbatches + microbatch

    def ids(self, stage: int, kind: str) -> list[int]:
        """Id of ``stage``'s ``kind`` action of each microbatch, -1 where missing (needs dense)."""
        assert self.dense is not None, "only a table without repeats or out-of-range actions"
        first = self.code(stage, kind)
        return self.dense[first:first + self.table.num_microbatches]

    def backward_ids(self, stage: int) -> list[int]:
        """``ids`` of the actions producing each microbatch's grad w.r.t. the stage input."""
        fused, split = self.ids(stage, BW), self.ids(stage, B)
        if -1 not in fused:
            return fused
        return [k if k >= 0 else other for k, other in zip(fused, split, strict=True)]

    def find(self, stage: int, kind: str, microbatch: int) -> int | None:
        if self.dense is None:
            return self.id_of.get((stage, kind, microbatch))
        t = self.table
        if not (0 <= stage < t.num_stages and 0 <= microbatch < t.num_microbatches):
            return None
        k = self.dense[self.code(stage, kind, microbatch)]
        return k if k >= 0 else None

    def backward(self, stage: int, microbatch: int) -> int | None:
        """Id of the action producing the grad w.r.t. the input of (stage, microbatch)."""
        found = self.find(stage, BW, microbatch)
        return found if found is not None else self.find(stage, B, microbatch)

    def crosses(self, stage: int, other: int) -> bool:
        placement = self.table.stage_to_rank
        return placement[stage] != placement[other]

    def crossings(self) -> list[int]:
        """Stages whose output goes to another rank."""
        place = self.table.stage_to_rank
        return [s for s in range(self.table.num_stages - 1) if place[s] != place[s + 1]]

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

    def partners(self) -> list[int]:
        """Id of every communication action's partner; -1 for compute actions and missing ones."""
        if self._partners is None:
            self._partners = [-1] * len(self.actions)
            if self.lowered:
                self._find_partners(self._partners)
        return self._partners

    def _find_partners(self, found: list[int]) -> None:
        if self.dense is None:  # repeats or actions out of range: look each one up
            for k, a in enumerate(self.actions):
                p = self.partner(k) if a.is_comm else None
                found[k] = -1 if p is None else p
            return
        for stage in range(self.table.num_stages):
            for kind, offset in PEER_OFFSET.items():
                mine, peer = self.ids(stage, kind), stage + offset
                if mine.count(-1) == len(mine) or not 0 <= peer < self.table.num_stages:
                    continue
                for k, p in zip(mine, self.ids(peer, PARTNER_KIND[kind]), strict=True):
                    if k >= 0:
                        found[k] = p

    def partner(self, k: int) -> int | None:
        """Id of the matching communication action, or None when the table lacks it."""
        a = self.actions[k]
        return self.find(a.stage + PEER_OFFSET[a.kind], PARTNER_KIND[a.kind], a.microbatch)


def _dense(actions: list[Action], num_stages: int, num_microbatches: int) -> list[int] | None:
    """Id by ``code``; None when an action lies out of range or repeats (or the table is so
    sparse that the array would dwarf it)."""
    size = num_stages * len(KINDS) * num_microbatches
    if size > 4 * len(actions) + 1024:
        return None
    if actions and (max(map(_STAGE, actions)) >= num_stages
                    or max(map(_MICROBATCH, actions)) >= num_microbatches):
        return None
    codes = [(a.stage * len(KINDS) + _KIND_CODE[a.kind]) * num_microbatches + a.microbatch
             for a in actions]
    dense = [-1] * size
    deque(map(dense.__setitem__, codes, range(len(codes))), maxlen=0)
    return dense if dense.count(-1) == size - len(codes) else None


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
