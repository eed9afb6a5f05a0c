"""Event-driven execution of a table: exact start/end times, or the cycle that deadlocks it."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import repeat

import attrs

from schedules.action import RECV_B, RECV_F, F
from schedules.errors import ScheduleError
from schedules.index import TableIndex

__all__ = ["Timing", "execute"]

_UNSET = -1.0  # times are >= 0, so a negative value means "not yet"


@attrs.frozen(eq=False)
class Timing:
    """Start and end time of every action id of the executed TableIndex."""

    start: list[float]
    end: list[float]


def execute(ix: TableIndex, duration: Sequence[float], transfer: Sequence[float],
            issue: Sequence[float] | None = None, transfer_issue: Sequence[float] | None = None) -> Timing:
    """Run every rank's row in order, each action as soon as its inputs are there.

    ``duration[k]`` is the compute time of action id ``k``; ``transfer[s]`` is the time to move
    stage ``s``'s output (or its grad) to the neighbouring rank. Compute waits for its
    dependencies (plus the transfer when they are on another rank and the table is not lowered).
    A run of consecutive communication actions is one group posted together: it completes when
    every member's partner has been posted, each pair taking ``transfer`` from the later post.
    Raises ScheduleError naming the waiting cycle when no rank can move. ``ix`` must have passed
    ``check_structure``: dependencies on the same rank then come earlier in the row, so the run
    waits only for inputs from other ranks, and each action is visited about once.

    With ``issue`` (host seconds per action id: a compute's launches, a send's or receive's post)
    and ``transfer_issue`` (per boundary stage: one post, where an unlowered table has no
    communication actions: each receive before its compute, each send after), every rank also
    has a host clock that walks its row and never waits for the device: a compute starts no
    earlier than its host begins issuing it and ends no earlier than its host has issued it all,
    an input from another rank leaves once its producer's host has posted the send, and a group is
    posted no earlier than its host has posted it (``_HostedRun``).
    """
    hosted = issue is not None and (any(issue) or any(transfer_issue or ()))
    run = _HostedRun(ix, duration, transfer, issue, transfer_issue) if hosted else _Run(ix, duration, transfer)
    queue = deque(range(len(ix.rows)))
    while queue:
        run.advance(queue.popleft(), queue)
    stuck = [r for r, row in enumerate(ix.rows) if run.pos[r] < len(row)]
    if stuck:
        raise ScheduleError(_deadlock_message(ix, run, stuck))
    return Timing(run.start, run.end)


def _inputs(ix: TableIndex) -> tuple[list[int], list[int]]:
    """For each action id, the producer it waits for on another rank without a receive (-1 for
    none: in a lowered table every input arrives through a receive on the action's own rank),
    and the boundary stage that input crosses."""
    producer, boundary = [-1] * len(ix.actions), [0] * len(ix.actions)
    for s in ix.crossings():
        for producers, consumers, receives in (
            (ix.ids(s, F), ix.ids(s + 1, F), ix.ids(s + 1, RECV_F)),
            (ix.backward_ids(s + 1), ix.backward_ids(s), ix.ids(s, RECV_B)),
        ):
            if receives.count(-1) != len(receives):
                kept = [(p, c) for p, c, r in zip(producers, consumers, receives, strict=True)
                        if r < 0]
                producers, consumers = [p for p, _ in kept], [c for _, c in kept]
            deque(map(producer.__setitem__, consumers, producers), maxlen=0)
            deque(map(boundary.__setitem__, consumers, repeat(s)), maxlen=0)
    return producer, boundary


class _Run:
    def __init__(self, ix: TableIndex, duration: Sequence[float], transfer: Sequence[float]):
        n = len(ix.actions)
        self.ix, self.duration, self.transfer = ix, duration, transfer
        self.waits_for, self.crossed = _inputs(ix)
        self.partner = ix.partners()
        self.delayed = any(transfer)  # free transfers need no boundary lookups
        self.stops: dict[int, int] = {}  # first member of a posted group -> the group's end
        self.start = [_UNSET] * n
        self.end = [_UNSET] * n
        self.posted = [_UNSET] * n
        self.pos = [0] * len(ix.rows)
        self.clock = [0.0] * len(ix.rows)
        self.waiters: dict[int, list[int]] = {}
        self.blocked: dict[int, int] = {}

    def advance(self, r: int, queue: deque[int]) -> None:
        """Run rank ``r`` until it waits or ends (the hot loop: kept in one function)."""
        row, partner, posted, waiters = self.ix.rows[r], self.partner, self.posted, self.waiters
        waits_for, start, end, duration = self.waits_for, self.start, self.end, self.duration
        pos, clock, size = self.pos[r], self.clock[r], len(row)
        while pos < size:
            k = row[pos]
            if partner[k] >= 0:  # a group: post it once, then complete it or wait
                stop = self.stops.get(k, -1)
                if stop < 0:
                    stop = self.stops[k] = self._post(row, pos, clock, queue)
                done = clock
                for m in row[pos:stop]:
                    met = posted[partner[m]]
                    if met < 0:
                        break
                    if met < clock:  # this side posted at ``clock``
                        met = clock
                    if self.delayed:
                        met += self.transfer[self.ix.actions[m].boundary or 0]
                    end[m] = met
                    if met > done:
                        done = met
                else:
                    pos, clock = stop, done
                    continue
                self._wait(r, partner[m])
                break
            t, d = clock, waits_for[k]
            if d >= 0:
                if end[d] < 0:
                    self._wait(r, d)
                    break
                t = max(t, end[d] + self.transfer[self.crossed[k]])
            start[k] = t
            end[k] = clock = t + duration[k]
            pos += 1
            if k in waiters:
                queue.extend(waiters.pop(k))
        self.pos[r], self.clock[r] = pos, clock

    def _wait(self, r: int, k: int) -> None:
        self.waiters.setdefault(k, []).append(r)
        self.blocked[r] = k

    def _post(self, row: list[int], pos: int, clock: float, queue: deque[int]) -> int:
        """Post every member of the group starting at ``pos``; returns where the group ends."""
        stop, size, partner, waiters = pos, len(row), self.partner, self.waiters
        while stop < size and partner[row[stop]] >= 0:
            m = row[stop]
            self.posted[m] = self.start[m] = clock
            if m in waiters:
                queue.extend(waiters.pop(m))
            stop += 1
        return stop


class _HostedRun(_Run):
    """A run with each rank's host clock beside its device clock (see ``execute``)."""

    def __init__(self, ix: TableIndex, duration: Sequence[float], transfer: Sequence[float],
                 issue: Sequence[float] | None, transfer_issue: Sequence[float] | None):
        super().__init__(ix, duration, transfer)
        n, posts = len(ix.actions), transfer_issue or [0.0] * ix.table.num_stages
        self.issue = list(issue) if issue is not None else [0.0] * n
        self.before, self.after = [0.0] * n, [0.0] * n  # posts around a compute of an unlowered table
        for consumer, producer in enumerate(self.waits_for):
            if producer >= 0:
                post = posts[self.crossed[consumer]]
                self.before[consumer] += post
                self.after[producer] += post
        self.host = [0.0] * len(ix.rows)
        self.sent = [0.0] * n  # when a compute's host had posted its sends (unlowered tables)

    def advance(self, r: int, queue: deque[int]) -> None:
        row, partner, posted, end, start = self.ix.rows[r], self.partner, self.posted, self.end, self.start
        pos, clock, host, size = self.pos[r], self.clock[r], self.host[r], len(row)
        while pos < size:
            k = row[pos]
            if partner[k] >= 0:
                stop = self.stops.get(k, -1)
                if stop < 0:
                    host += sum(self.issue[m] for m in row[pos:self._group_end(row, pos)])
                    stop = self.stops[k] = self._post(row, pos, max(clock, host), queue)
                    clock = max(clock, host)
                done = clock
                for m in row[pos:stop]:
                    met = posted[partner[m]]
                    if met < 0:
                        break
                    met = max(met, clock) + (self.transfer[self.ix.actions[m].boundary or 0] if self.delayed else 0.0)
                    end[m] = met
                    done = max(done, met)
                else:
                    pos, clock = stop, done
                    continue
                self._wait(r, partner[m])
                break
            d = self.waits_for[k]
            if d >= 0 and end[d] < 0:
                self._wait(r, d)
                break
            issued = host + self.before[k]  # the host posts the receive, then issues the compute
            if d < 0:
                t = max(clock, issued)
            else:  # the data leaves once it is made and its host has posted the send
                t = max(clock, issued, max(end[d], self.sent[d]) + self.transfer[self.crossed[k]])
            host = issued + self.issue[k]
            start[k] = t
            end[k] = clock = max(t + self.duration[k], host)
            host += self.after[k]
            self.sent[k] = host
            pos += 1
            if k in self.waiters:
                queue.extend(self.waiters.pop(k))
        self.pos[r], self.clock[r], self.host[r] = pos, clock, host

    def _group_end(self, row: list[int], pos: int) -> int:
        while pos < len(row) and self.partner[row[pos]] >= 0:
            pos += 1
        return pos


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
