"""List scheduling in continuous time: each idle rank starts its most urgent ready action."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import attrs

from schedules.action import Action, B, F, W
from schedules.errors import ScheduleError
from schedules.table import Table

__all__ = ["Order", "Times", "list_schedule"]

# (forward, backward_input, backward_weight) per stage, and the transfer time of each boundary
Times = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], tuple[float, ...]]
Key = Callable[[str, int, int], tuple[float, ...]]  # (kind, stage, microbatch) -> urgency, lowest first
Choice = tuple[str, int, int]
# w_mode -> the rank prefix of (F or B, W) below the live limit, and at it (lowest first)
_W_RANK: dict[str, tuple[tuple[int, int], tuple[int, int]] | tuple[()]] = {
    "fill": ((0, 1), (0, 0)), "free": ((0, 1), (1, 0)), "key": (),
}


@attrs.frozen
class Order:
    """A finished run's order (each rank's (kind, stage, microbatch) in turn) and makespan; `table()` makes the
    Table, only for an order kept: a search runs hundreds and building each one's Actions was a tenth of it."""

    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    rows: list[list[Choice]] = attrs.field(eq=False, repr=False)
    makespan: float

    def table(self) -> Table:
        rows = [[Action(s, kind, i) for kind, s, i in row] for row in self.rows]
        return Table(len(self.stage_to_rank), self.num_microbatches, self.stage_to_rank, rows)


def list_schedule(
    stage_to_rank: Sequence[int], num_microbatches: int, times: Times, *,
    live_limit: Sequence[int], key: Key, w_mode: str = "fill", patience: float = 0.0,
    reserve: str = "one", lead: Sequence[int] = (), bound: float = float("inf"),
) -> Order | None:
    """The order a greedy list scheduler builds for these times (its makespan: `Order.makespan`).

    Each stage runs its F, B and W in microbatch order. Whenever a rank is idle it starts, of the
    actions whose inputs have arrived (a dependency on another rank adds the boundary's transfer
    time), the one with the lowest ``key``; a forward only while the rank holds fewer than
    ``live_limit[rank]`` stage-microbatches (live from F's start until W ends), less one for each
    later stage of the rank (``reserve="one"``: a rank full of microbatches that must come back
    through it would deadlock), or 2r+1 for each on rank r (``"ramp"``: the warm-up of PyTorch's
    V and interleaved orders, shorter down the pipeline), or none (``"none"``). With ``patience`` > 0 a rank leaves the best ready action waiting
    when a more urgent one arrives within ``patience`` times its duration. Weight passes
    (``w_mode``): "fill" starts one only when no F or B is ready (it fills what would be a
    bubble) or the rank is at its live limit, then in ``key`` order; "free" likewise, but at the
    limit before anything (it frees room for the next forward); "key" by ``key`` alone.
    Rank ``r`` runs a stage's forwards at most ``lead[r]`` microbatches ahead of its next stage. ``simulate`` gives the
    table at most this makespan: it starts every action as soon as its rank and inputs allow.
    None as soon as an action would end after ``bound``, or its rank's work left would (a search needs only
    better orders).
    Raises ScheduleError when the limits leave every rank waiting (unless the run was abandoned first).
    """
    run = _Run(stage_to_rank, num_microbatches, times, live_limit, reserve)
    run.lead = list(lead) or [num_microbatches] * len(run.stages)
    w_rank, look = _W_RANK[w_mode], patience > 0
    while run.remaining:
        if not run.events:
            raise ScheduleError(
                f"no rank can start anything: live_limit {list(live_limit)} is too small for this "
                "placement; allow more live stage-microbatches per rank")
        now, r, ends = heapq.heappop(run.events)
        if ends:
            run.wake(now)
        if run.free_at[r] > now:
            continue
        if run.idle[r]:  # it found nothing ready nor coming, and no input of it has been produced since
            run.wait(r)
            continue
        best, best_key, coming = run.choose(r, now, key, w_rank, look)
        duration = run.duration[best[0]][best[1]] if best is not None else 0.0
        if best is None or any(at < now + patience * duration and k < best_key for at, k in coming):
            run.hold(r, coming)
            continue
        if now + duration > bound or now + run.left[r] > bound * (1 + 1e-9) + 1e-12:
            return None  # it ends after bound, or this rank's work left does (margin: never for a tie, kept)
        run.start(r, now, best)
    return Order(tuple(stage_to_rank), num_microbatches, run.rows, run.makespan)


class _Run:
    """The state of one list-scheduling run."""

    def __init__(self, stage_to_rank: Sequence[int], m: int, times: Times, live_limit: Sequence[int],
                 reserve: str) -> None:
        num_stages, num_ranks = len(stage_to_rank), max(stage_to_rank) + 1
        self.placement, self.m, self.limit, self.last = stage_to_rank, m, live_limit, num_stages - 1
        self.stages = [[s for s in range(num_stages) if stage_to_rank[s] == r] for r in range(num_ranks)]
        scale = {"none": lambda r: 0, "one": lambda r: 1, "ramp": lambda r: 2 * r + 1}[reserve]
        self.held = [sum(t > s for t in self.stages[stage_to_rank[s]]) * scale(stage_to_rank[s])
                     for s in range(num_stages)]
        self.duration = {F: times[0], B: times[1], W: times[2]}
        self.transfer = [times[3][s] if s < self.last and stage_to_rank[s] != stage_to_rank[s + 1] else 0.0
                         for s in range(num_stages)]  # no transfer within a rank
        self.next = {kind: [0] * num_stages for kind in (F, B, W)}
        self.ended = {kind: [[-1.0] * m for _ in range(num_stages)] for kind in (F, B, W)}
        self.free_at, self.live = [0.0] * num_ranks, [0] * num_ranks
        self.lead = [m] * num_ranks
        self.after = [next((t for t in self.stages[stage_to_rank[s]] if t > s), -1) for s in range(num_stages)]
        self.rows: list[list[Choice]] = [[] for _ in range(num_ranks)]
        self.events = [(0.0, r, False) for r in range(num_ranks)]  # (time, rank, an action of it ends)
        self.waiting: list[int] = []
        # a rank that looked and found nothing ready nor coming finds the same until an action that makes one
        # of its inputs starts (its end time is known from its start): F of the stage before, B of the stage after
        self.idle = [False] * num_ranks
        self.left = [m * sum(times[k][s] for k in range(3) for s in self.stages[r]) for r in range(num_ranks)]
        self.feeds = {F: [stage_to_rank[s + 1] if s < self.last else -1 for s in range(num_stages)],
                      B: [stage_to_rank[s - 1] if s > 0 else -1 for s in range(num_stages)],
                      W: [-1] * num_stages}
        self.remaining, self.makespan = 3 * num_stages * m, 0.0

    def wait(self, r: int) -> None:
        """Rank ``r`` waits for the next action to end. Once: a rank listed twice would be woken twice, and with
        actions of zero time (a stage without weights has no W) the copies multiplied at every end."""
        if r not in self.waiting:
            self.waiting.append(r)

    def hold(self, r: int, coming: list[tuple[float, tuple[float, ...]]]) -> None:
        """Rank ``r`` starts nothing now: it looks again when the soonest input coming arrives, and at the next end
        (an input whose producer ends meanwhile may come sooner); with nothing coming (so nothing was ready either),
        only once a producer of its inputs has started: until then every look finds the same nothing."""
        if coming:
            heapq.heappush(self.events, (min(at for at, _ in coming), r, False))
        else:
            self.idle[r] = True
        self.wait(r)

    def wake(self, now: float) -> None:
        for other in self.waiting:
            heapq.heappush(self.events, (now, other, False))
        self.waiting.clear()

    def arrival(self, kind: str, s: int, i: int) -> float:
        """When the input of (s, kind, i) is there; -1 while its producer has not started."""
        ended = self.ended
        if kind == F:
            if s == 0:
                return 0.0
            t = ended[F][s - 1][i]
            return t + self.transfer[s - 1] if t >= 0 else -1.0
        if kind == W:
            return ended[B][s][i]
        t = ended[F][s][i]
        if t < 0 or s == self.last:
            return t
        up = ended[B][s + 1][i]
        return max(t, up + self.transfer[s]) if up >= 0 else -1.0

    def choose(self, r: int, now: float, key: Key, w_rank: tuple[tuple[int, int], tuple[int, int]], look: bool
               ) -> tuple[Choice | None, tuple[float, ...] | None, list[tuple[float, tuple[float, ...]]]]:
        """The most urgent ready action of rank ``r``, its key, and (arrival, key) of those coming (the hot loop
        of a planner's order search: `arrival` inlined, a key made only for an action that can be chosen)."""
        best, best_key, coming = None, None, []
        live, limit, m, lead = self.live[r], self.limit[r], self.m, self.lead[r]
        nf, nb, nw = self.next[F], self.next[B], self.next[W]
        ef, eb = self.ended[F], self.ended[B]
        transfer, held, after, last = self.transfer, self.held, self.after, self.last
        prefix = w_rank[live >= limit] if w_rank else None
        for s in self.stages[r]:
            i = nf[s]  # F: its input from the stage before
            if i < m and live + held[s] < limit and not (after[s] >= 0 and i - nf[after[s]] >= lead):
                if s == 0:
                    at = 0.0
                else:
                    t = ef[s - 1][i]
                    at = t + transfer[s - 1] if t >= 0 else -1.0
                if at >= 0:
                    best, best_key = self._consider(F, s, i, at, now, key, prefix, look, best, best_key, coming)
            i = nb[s]  # B: its forward here and the grad from the stage after
            if i < m:
                at = ef[s][i]
                if at >= 0 and s != last:
                    up = eb[s + 1][i]
                    at = max(at, up + transfer[s]) if up >= 0 else -1.0
                if at >= 0:
                    best, best_key = self._consider(B, s, i, at, now, key, prefix, look, best, best_key, coming)
            i = nw[s]  # W: its B
            if i < m:
                at = eb[s][i]
                if at >= 0:
                    best, best_key = self._consider(W, s, i, at, now, key, prefix, look, best, best_key, coming)
        return best, best_key, coming

    @staticmethod
    def _consider(kind: str, s: int, i: int, at: float, now: float, key: Key, prefix: tuple[int, int] | None,
                  look: bool, best: Choice | None, best_key: tuple[float, ...] | None,
                  coming: list[tuple[float, tuple[float, ...]]]) -> tuple[Choice | None, tuple[float, ...] | None]:
        """`best` and its key after action (kind, s, i), whose input arrives at `at`, is weighed at `now`."""
        if at > now and not look:
            coming.append((at, ()))
            return best, best_key
        k = ((prefix[kind == W],) if prefix is not None else ()) + key(kind, s, i)
        if at > now:
            coming.append((at, k))
        elif best_key is None or k < best_key:
            return (kind, s, i), k
        return best, best_key

    def start(self, r: int, now: float, choice: Choice) -> None:
        kind, s, i = choice
        end = now + self.duration[kind][s]
        self.ended[kind][s][i], self.free_at[r] = end, end
        self.left[r] -= self.duration[kind][s]
        self.next[kind][s] += 1
        self.idle[r] = False
        fed = self.feeds[kind][s]
        if fed >= 0:
            self.idle[fed] = False
        self.live[r] += (kind == F) - (kind == W)
        self.rows[r].append(choice)
        self.remaining -= 1
        self.makespan = max(self.makespan, end)
        heapq.heappush(self.events, (end, r, True))
