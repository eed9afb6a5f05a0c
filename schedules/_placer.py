"""_placer: the reference run that lower places messages on, kept exact placement by placement."""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Sequence

import attrs

from schedules.execute import execute
from schedules.index import TableIndex

__all__ = ["Links", "Placer"]


@attrs.frozen
class Links:
    """Message ``n`` goes from compute step ``produced[n]`` of rank ``src[n]`` to compute step
    ``consumed[n]`` of rank ``dst[n]`` (steps count compute actions only)."""

    src: list[int]
    produced: list[int]
    dst: list[int]
    consumed: list[int]


class Placer:
    """Compute rows, the messages placed so far in the gaps between them, and a run of both.

    ``start[r][i]`` and ``end[r][i]`` time compute step ``i`` of rank ``r`` as ``execute`` would
    time the table lowered so far, under free communication: gap ``i`` of a rank (before its
    step ``i``) is one group, posted when step ``i - 1`` ends and complete once every partner's
    gap has posted; an unplaced message lets its consumer start when its producer ends. A
    message that meets in gaps both ranks spend idle changes no time; one whose receiver must
    wait delays some computes, and only those are timed again.
    """

    def __init__(self, index: TableIndex, duration: Sequence[float], links: Links):
        timing = execute(index, duration, [0.0] * index.table.num_stages)  # the one full run
        spans = [(row[0], row[-1] + 1) if row else (0, 0) for row in index.rows]
        self.duration = [list(duration[a:b]) for a, b in spans]
        self.start = [timing.start[a:b] for a, b in spans]
        self.end = [timing.end[a:b] for a, b in spans]
        self.links = links
        self.send_gap = [-1] * len(links.src)  # gap of the producer's rank holding the send
        self.recv_gap = [-1] * len(links.src)  # gap of the consumer's rank holding the receive
        # the messages of a gap, as a chain: ``gaps[rank][gap]`` is one, ``next_send[n]`` (or
        # ``next_receive[n]`` on the receiving side) the one after it, -1 at the end
        self.gaps: list[dict[int, int]] = [{} for _ in index.rows]
        self.next_send = [-1] * len(links.src)
        self.next_receive = [-1] * len(links.src)
        self.incoming = [[-1] * len(row) for row in index.rows]  # message each compute waits for
        self.outgoing = [[-1] * len(row) for row in index.rows]  # message each compute sends
        for rows, ranks, steps in ((self.outgoing, links.src, links.produced),
                                   (self.incoming, links.dst, links.consumed)):
            for n, (rank, step) in enumerate(zip(ranks, steps, strict=True)):
                rows[rank][step] = n

    def place_all(self) -> None:
        """Place every message, in the order their producers end (ties: in message order); a
        message whose producer moved since it was queued goes back in at its new time."""
        src, produced, dst, consumed = (self.links.src, self.links.produced, self.links.dst,
                                        self.links.consumed)
        ready = [self.end[r][i] for r, i in zip(src, produced, strict=True)]
        first = sorted(range(len(ready)), key=ready.__getitem__)  # stable: ties by message
        again: list[tuple[float, int]] = []
        k = 0
        while k < len(first) or again:
            if again and (k == len(first) or again[0] < (ready[first[k]], first[k])):
                queued, n = heapq.heappop(again)
            else:
                n = first[k]
                queued, k = ready[n], k + 1
            now = self.end[src[n]][produced[n]]
            if queued != now:
                heapq.heappush(again, (now, n))
            else:
                self.place(n, src[n], produced[n], dst[n], consumed[n])

    def posted(self, rank: int, gap: int) -> float:
        """When ``rank`` reaches its gap ``gap`` (and posts the group there)."""
        return self.end[rank][gap - 1] if gap > 0 else 0.0

    def meeting_times(self) -> list[float]:
        """When each placed message completes: once both of its sides have posted."""
        end, links = self.end, self.links
        return [max(end[src][send - 1], end[dst][recv - 1] if recv else 0.0)
                for src, dst, send, recv in zip(links.src, links.dst, self.send_gap,
                                                self.recv_gap, strict=True)]

    def place(self, n: int, src: int, produced: int, dst: int, consumed: int) -> None:
        """Put message ``n`` (from ``src`` step ``produced`` to ``dst`` step ``consumed``) in the
        first gap after its producer that overlaps a gap of the receiver before its consumer, at
        the latest shared time; when there is none, right after the producer, with the receiver
        waiting before the compute it would be running."""
        starts, ends, dst_starts, dst_ends = (self.start[src], self.end[src], self.start[dst],
                                              self.end[dst])
        ready, needed, peer = ends[produced], dst_starts[consumed], -1
        for slot in range(produced + 1, len(ends) + 1):
            low = ends[slot - 1]  # >= ready: the gap begins after the producer
            if low > needed:
                break
            high = min(starts[slot], needed) if slot < len(starts) else needed
            meet = min(bisect_right(dst_ends, high), consumed)
            if low <= high and dst_starts[meet] >= low:
                peer = meet
                break
        waits = peer < 0
        if waits:
            slot, peer = produced + 1, min(bisect_right(dst_ends, ready), consumed)
        self.send_gap[n], self.recv_gap[n] = slot, peer
        sender, receiver = self.gaps[src], self.gaps[dst]
        self.next_send[n], sender[slot] = sender.get(slot, -1), n
        self.next_receive[n], receiver[peer] = receiver.get(peer, -1), n
        if waits:
            self._settle([(src, slot), (dst, peer), (dst, consumed)])

    def members(self, rank: int, gap: int) -> list[int]:
        """The messages placed in gap ``gap`` of ``rank``, last placed first."""
        found, n = [], self.gaps[rank].get(gap, -1)
        while n >= 0:
            found.append(n)
            n = self.next_send[n] if self.links.src[n] == rank else self.next_receive[n]
        return found

    def _partner_gap(self, rank: int, n: int) -> tuple[int, int]:
        if rank == self.links.src[n]:
            return self.links.dst[n], self.recv_gap[n]
        return self.links.src[n], self.send_gap[n]

    def _evaluate(self, rank: int, step: int) -> float:
        """Start of compute ``step`` of ``rank`` from the current times of what it waits for."""
        t = self.posted(rank, step)
        for n in self.members(rank, step):
            t = max(t, self.posted(*self._partner_gap(rank, n)))
        n = self.incoming[rank][step]
        if n >= 0 and self.recv_gap[n] < 0:
            t = max(t, self.end[self.links.src[n]][self.links.produced[n]])
        return t

    def _settle(self, seeds: list[tuple[int, int]]) -> None:
        """Time again every compute that waits, directly or not, on what changed at ``seeds``.

        Placing a message only adds waits, so times only grow; each compute whose end moves
        hands its followers on: the next compute of its rank, the partners of the gap after it,
        and the consumer of its message while that is unplaced.
        """
        work = [(self.start[r][i], r, i) for r, i in seeds if i < len(self.start[r])]
        heapq.heapify(work)
        while work:
            _, r, i = heapq.heappop(work)
            t = self._evaluate(r, i)
            if t == self.start[r][i]:
                continue
            self.start[r][i], self.end[r][i] = t, t + self.duration[r][i]
            after = [(r, i + 1)] + [self._partner_gap(r, n) for n in self.members(r, i + 1)]
            n = self.outgoing[r][i]
            if n >= 0 and self.recv_gap[n] < 0:
                after.append((self.links.dst[n], self.links.consumed[n]))
            for r2, i2 in after:
                if i2 < len(self.start[r2]):
                    heapq.heappush(work, (self.start[r2][i2], r2, i2))
