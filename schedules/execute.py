"""Event-driven execution of a table: exact start/end times, or the cycle that deadlocks it."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs

from schedules.errors import ScheduleError
from schedules.index import NO_BOUNDARY, TableIndex

__all__ = ["Timing", "execute"]

_UNSET = -1.0  # times are >= 0, so a negative value means "not yet"


@attrs.frozen(eq=False)
class Timing:
    """Start and end time of every action id of the executed TableIndex."""

    start: list[float]
    end: list[float]


def execute(ix: TableIndex, duration: Sequence[float], transfer: Sequence[float]) -> Timing:
    """Run every rank's row in order, each action as soon as its inputs are there.

    ``duration[k]`` is the compute time of action id ``k``; ``transfer[s]`` is the time to move
    stage ``s``'s output (or its grad) to the neighbouring rank. Compute waits for its
    dependencies (plus the transfer when they are on another rank and the table is not lowered).
    A run of consecutive communication actions is one group posted together: it completes when
    every member's partner has been posted, each pair taking ``transfer`` from the later post.
    Raises ScheduleError naming the waiting cycle when no rank can move.
    """
    run = _Run(ix, duration, transfer)
    queue = deque(range(len(ix.rows)))
    while queue:
        run.advance(queue.popleft(), queue)
    stuck = [r for r, row in enumerate(ix.rows) if run.pos[r] < len(row)]
    if stuck:
        raise ScheduleError(_deadlock_message(ix, run, stuck))
    return Timing(run.start, run.end)


class _Run:
    def __init__(self, ix: TableIndex, duration: Sequence[float], transfer: Sequence[float]):
        n = len(ix.actions)
        self.ix, self.duration, self.transfer = ix, duration, transfer
        self.deps = [ix.dependencies(k) if not ix.actions[k].is_comm else [] for k in range(n)]
        self.partner = [ix.partner(k) if ix.actions[k].is_comm else None for k in range(n)]
        self.boundary = [a.boundary or 0 for a in ix.actions]
        self.start = [_UNSET] * n
        self.end = [_UNSET] * n
        self.posted = [_UNSET] * n
        self.pos = [0] * len(ix.rows)
        self.clock = [0.0] * len(ix.rows)
        self.waiters: dict[int, list[int]] = {}
        self.blocked: dict[int, int] = {}
        self.group_stop = [_group_stops(ix, row) for row in ix.rows]

    def advance(self, r: int, queue: deque[int]) -> None:
        row, comm = self.ix.rows[r], self.partner
        while self.pos[r] < len(row):
            k = row[self.pos[r]]
            done = self._group(r, k, queue) if comm[k] is not None else self._compute(r, k, queue)
            if not done:
                return

    def _wait(self, r: int, k: int) -> bool:
        self.waiters.setdefault(k, []).append(r)
        self.blocked[r] = k
        return False

    def _wake(self, k: int, queue: deque[int]) -> None:
        if k in self.waiters:
            queue.extend(self.waiters.pop(k))

    def _compute(self, r: int, k: int, queue: deque[int]) -> bool:
        t = self.clock[r]
        deps = self.deps[k]
        assert deps is not None, "validation guarantees every dependency exists"
        for d, boundary in deps:
            ready = self.end[d]
            if ready < 0:
                return self._wait(r, d)
            if boundary != NO_BOUNDARY:
                ready += self.transfer[boundary]
            t = max(t, ready)
        self.start[k] = t
        self.end[k] = self.clock[r] = t + self.duration[k]
        self.pos[r] += 1
        self._wake(k, queue)
        return True

    def _group(self, r: int, k: int, queue: deque[int]) -> bool:
        row, pos = self.ix.rows[r], self.pos[r]
        members = row[pos:self.group_stop[r][pos]]
        if self.posted[k] < 0:
            for m in members:
                self.posted[m] = self.start[m] = self.clock[r]
                self._wake(m, queue)
        for m in members:
            p = self.partner[m]
            assert p is not None, "validation guarantees every communication has a partner"
            if self.posted[p] < 0:
                return self._wait(r, p)
        done = self.clock[r]
        for m in members:
            p = self.partner[m]
            assert p is not None
            self.end[m] = max(self.posted[m], self.posted[p]) + self.transfer[self.boundary[m]]
            done = max(done, self.end[m])
        self.clock[r] = done
        self.pos[r] += len(members)
        for m in members:
            self._wake(m, queue)
        return True


def _group_stops(ix: TableIndex, row: list[int]) -> list[int]:
    """For each position, the end of the run of communication actions starting there."""
    stops = [0] * len(row)
    following = len(row)
    for pos in range(len(row) - 1, -1, -1):
        if ix.actions[row[pos]].is_comm:
            stops[pos] = following
        else:
            stops[pos] = pos + 1
            following = pos
    return stops


def _deadlock_message(ix: TableIndex, run: _Run, stuck: list[int]) -> str:
    cycle = _cycle(ix, run, stuck)
    waits = []
    for r in cycle:
        at = ix.actions[ix.rows[r][run.pos[r]]]
        need = run.blocked[r]
        what = "to post" if ix.actions[need].is_comm else "to finish"
        waits.append(f"rank {r} waits at {at} for rank {ix.rank[need]} {what} {ix.actions[need]}")
    fix = (
        "pair the communication so both sides post it in one group (SEND_F with RECV_B, like "
        "send_forward_recv_backward) or reorder it; schedules.lower places it deadlock-free"
        if ix.lowered else
        "reorder the rows so every action's inputs are produced before it waits for them"
    )
    marks = {(r, run.pos[r]) for r in cycle} | {(ix.rank[run.blocked[r]], ix.step[run.blocked[r]])
                                                for r in cycle}
    return (
        f"deadlock: {len(stuck)} of {len(ix.rows)} ranks can never finish: "
        + "; ".join(waits) + f"; {fix}\n" + ix.table.to_grid(marks, crop=True)
    )


def _cycle(ix: TableIndex, run: _Run, stuck: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    r = stuck[0]
    while r not in seen:
        seen[r] = len(seen)
        r = ix.rank[run.blocked[r]]
    order = list(seen)
    return order[seen[r]:]
