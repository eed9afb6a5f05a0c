"""The lowering and execution algorithms as they were before lowering became event-driven.

``reference_lower`` re-ran the whole table (``reference_execute``) after every message whose
receiver had to wait; the tests check that ``schedules.lower`` and ``schedules.execute`` give
exactly what these give.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence

import attrs

from schedules.action import BW, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F
from schedules.costs import Costs
from schedules.errors import ScheduleError
from schedules.execute import Timing, _deadlock_message
from schedules.index import NO_BOUNDARY, TableIndex
from schedules.table import Table
from schedules.validate import check_structure

__all__ = ["reference_execute", "reference_lower"]

_UNSET = -1.0


def reference_execute(ix: TableIndex, duration: Sequence[float], transfer: Sequence[float],
                      issue: Sequence[float] | None = None,
                      transfer_issue: Sequence[float] | None = None) -> Timing:
    """Run every rank's row in order, each action as soon as its inputs are there.

    ``duration[k]`` is the compute time of action id ``k``; ``transfer[s]`` is the time to move
    stage ``s``'s output (or its grad) to the neighbouring rank. Compute waits for its
    dependencies (plus the transfer when they are on another rank and the table is not lowered).
    A run of consecutive communication actions is one group posted together: it completes when
    every member's partner has been posted, each pair taking ``transfer`` from the later post.
    Raises ScheduleError naming the waiting cycle when no rank can move.

    The host (``issue`` per action, ``transfer_issue`` per boundary): each rank's host clock
    walks its row; before a compute it posts a receive for each input from another rank, then
    issues the compute, then posts a send for each consumer on another rank; before a group it
    posts every member. A compute starts no earlier than its issue starts and ends no earlier
    than its issue ends; an input from another rank leaves at the later of its producer's end and
    the producer's host having posted its sends; a group is posted at the later of the device's
    and the host's clocks.
    """
    run = _Run(ix, duration, transfer, issue, transfer_issue)
    queue = deque(range(len(ix.rows)))
    while queue:
        run.advance(queue.popleft(), queue)
    stuck = [r for r, row in enumerate(ix.rows) if run.pos[r] < len(row)]
    if stuck:
        raise ScheduleError(_deadlock_message(ix, run, stuck))
    return Timing(run.start, run.end)


class _Run:
    def __init__(self, ix: TableIndex, duration: Sequence[float], transfer: Sequence[float],
                 issue: Sequence[float] | None = None, transfer_issue: Sequence[float] | None = None):
        n = len(ix.actions)
        self.issue = list(issue or [0.0] * n)
        self.transfer_issue = list(transfer_issue or [0.0] * ix.table.num_stages)
        self.host = [0.0] * len(ix.rows)
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
        self.sends = [0.0] * n  # host seconds of the sends posted after a compute (unlowered tables)
        self.sent = [0.0] * n  # the host's time once a compute's sends were posted
        for deps in self.deps:
            for d, boundary in deps or []:
                if boundary != NO_BOUNDARY:
                    self.sends[d] += self.transfer_issue[boundary]

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
        receives = 0.0
        for d, boundary in deps:
            ready = self.end[d]
            if ready < 0:
                return self._wait(r, d)
            if boundary != NO_BOUNDARY:
                ready = max(ready, self.sent[d]) + self.transfer[boundary]
                receives += self.transfer_issue[boundary]
            t = max(t, ready)
        issued = self.host[r] + receives
        t = max(t, issued)
        self.start[k] = t
        self.end[k] = self.clock[r] = max(t + self.duration[k], issued + self.issue[k])
        self.host[r] = self.sent[k] = issued + self.issue[k] + self.sends[k]
        self.pos[r] += 1
        self._wake(k, queue)
        return True

    def _group(self, r: int, k: int, queue: deque[int]) -> bool:
        row, pos = self.ix.rows[r], self.pos[r]
        members = row[pos:self.group_stop[r][pos]]
        if self.posted[k] < 0:
            self.host[r] += sum(self.issue[m] for m in members)
            self.clock[r] = max(self.clock[r], self.host[r])
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



@attrs.frozen
class _Message:
    """``send`` goes on the producer's rank after it, ``recv`` on the consumer's rank before it."""

    send: Action
    recv: Action
    producer: Action
    consumer: Action


def reference_lower(table: Table, *, costs: Costs | None = None) -> Table:
    """Insert SEND/RECV actions for every dependency between stages on different ranks.

    The runtime's rendezvous semantics (see ``simulate``) need both ranks of a message to be
    between compute actions at once. Messages are placed in time order on a reference run of
    ``table`` (under ``costs``; default F = B = W = 1, free communication): each goes in the
    first gap after its producer that overlaps a gap of the receiver before its consumer, at the
    latest shared time, so the send follows the producing compute and the receive comes as late
    as that allows. Messages that meet in one gap form one group: that is how 1F1B's steady state
    pairs SEND_F with RECV_B. When no gaps overlap, the receiver waits in the gap before the
    action it would be running, and the rest is placed on the run updated for that wait.
    Each rank posts its messages in the order they meet, so the lowered table cannot deadlock
    whatever the real costs, and each pair of ranks receives in the order of the sends.
    """
    if table.is_lowered:
        raise ScheduleError("the table already holds communication actions; lower the table "
                            "the schedule function returned, once")
    check_structure(table)
    costs = Costs() if costs is None else costs
    _check_costs(table, costs)
    placer = _Placer(table, costs)
    queue = [(placer.end[m.producer], n, m) for n, m in enumerate(_messages(table))]
    heapq.heapify(queue)
    while queue:
        ready, n, message = heapq.heappop(queue)
        if ready != placer.end[message.producer]:  # the run moved since: requeue
            heapq.heappush(queue, (placer.end[message.producer], n, message))
            continue
        if not placer.place(message):
            placer.rerun()
    return placer.finish()


def _check_costs(table: Table, costs: Costs) -> None:
    costs.check(table.num_stages, table.num_ranks)
    for _, _, action in table.positions():
        if not costs.compute_time(action) > 0:
            raise ScheduleError(
                f"lower orders messages by a reference run and needs positive compute times; "
                f"{action} costs {costs.compute_time(action)}: pass costs with times > 0 or none"
            )


def _messages(table: Table) -> list[_Message]:
    """Every message between ranks: forward activations and the grads coming back."""
    found = []
    backward = {(a.stage, a.microbatch): a for _, _, a in table.positions()
                if a.kind in (B, BW)}
    for stage in range(table.num_stages - 1):
        if table.stage_to_rank[stage] == table.stage_to_rank[stage + 1]:
            continue
        for mb in range(table.num_microbatches):
            found.append(_Message(Action(stage, SEND_F, mb), Action(stage + 1, RECV_F, mb),
                                  Action(stage, F, mb), Action(stage + 1, F, mb)))
            found.append(_Message(Action(stage + 1, SEND_B, mb), Action(stage, RECV_B, mb),
                                  backward[(stage + 1, mb)], backward[(stage, mb)]))
    return found


class _Placer:
    """Working state of one ``lower`` call: the gaps of every row and the current reference run."""

    def __init__(self, table: Table, costs: Costs) -> None:
        self.table, self.costs = table, costs
        self.step = {a: step for _, step, a in table.positions()}
        self.rank = {a: rank for rank, _, a in table.positions()}
        self.gaps: list[list[list[Action]]] = [[[] for _ in range(len(row) + 1)]
                                               for row in table.rows]
        self.rerun()

    def current(self) -> Table:
        rows = []
        for row, gaps in zip(self.table.rows, self.gaps, strict=True):
            rows.append([a for step, gap in enumerate(gaps) for a in [*gap, *row[step:step + 1]]])
        return attrs.evolve(self.table, rows=rows)

    def rerun(self) -> None:
        """Time the table as placed so far (messages not yet placed move freely)."""
        index = TableIndex(self.current())
        duration = [self.costs.compute_time(a) if a.is_compute else 0.0 for a in index.actions]
        timing = reference_execute(index, duration, [0.0] * self.table.num_stages)
        self.start = dict(zip(index.actions, timing.start, strict=True))
        self.end = dict(zip(index.actions, timing.end, strict=True))
        self.ends = [[self.end[a] for a in row] for row in self.table.rows]

    def gap(self, rank: int, slot: int) -> tuple[float, float]:
        """(begin, end) of the gap before step ``slot`` of ``rank``'s row in the current run."""
        row = self.table.rows[rank]
        begin = self.end[row[slot - 1]] if slot > 0 else -math.inf
        return begin, self.start[row[slot]] if slot < len(row) else math.inf

    def place(self, message: _Message) -> bool:
        """Put ``message`` where both ranks are idle at once; False when the receiver must wait."""
        src, dst = self.rank[message.producer], self.rank[message.consumer]
        ready, needed = self.end[message.producer], self.start[message.consumer]
        last = self.step[message.consumer]
        for slot in range(self.step[message.producer] + 1, len(self.table.rows[src]) + 1):
            begin, end = self.gap(src, slot)
            if begin > needed:
                break
            low, high = max(begin, ready), min(end, needed)
            peer = min(bisect_right(self.ends[dst], high), last)
            if low <= high and self.gap(dst, peer)[1] >= low:
                self._insert(message, slot, peer)
                return True
        self._insert(message, self.step[message.producer] + 1,
                     min(bisect_right(self.ends[dst], ready), last))
        return False

    def _insert(self, message: _Message, slot: int, peer: int) -> None:
        self.gaps[self.rank[message.producer]][slot].append(message.send)
        self.gaps[self.rank[message.consumer]][peer].append(message.recv)

    def finish(self) -> Table:
        """Order each gap by when its messages meet (the send's end), then return the table."""
        self.rerun()
        for gaps in self.gaps:
            for gap in gaps:
                gap.sort(key=lambda a: (self.end[a if a.is_send else a.partner()],
                                        a.kind in (SEND_B, RECV_B), min(a.stage, a.peer_stage or 0),
                                        a.microbatch))
        return self.current()
