"""Replicas: a table's ranks replicated unequally, microbatches routed to the replicas round-robin."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from schedules.action import BW, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W
from schedules.costs import Costs
from schedules.errors import ScheduleError
from schedules.table import Table

__all__ = ["ORDERS", "Replicas", "RoutedRun", "lower_replicated", "replica_rows", "simulate_replicated"]

ORDERS = ("split", "own")  # how a replica orders its actions: see `replica_rows`


def _counts(value: Sequence[int]) -> tuple[int, ...]:
    counts = tuple(value)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ScheduleError(f"replicas must be one int >= 1 per pipeline rank, like (2, 1); got {value!r}")
    return counts


@attrs.frozen
class Replicas:
    """``counts[q]`` ranks run table rank ``q`` (a pipeline position), numbered position by position.

    Routing is a layer over an ordinary table, not a new kind of schedule: the table says in which
    order position ``q`` runs its actions for all microbatches; replica ``k`` of ``q`` runs the
    subsequence whose microbatch ``mb`` has ``mb % counts[q] == k`` (round-robin: deterministic, each
    replica gets the same share when ``counts[q]`` divides the microbatch count, and consecutive
    microbatches start on different replicas at once). A transfer of microbatch ``mb`` goes from the
    replica of the sending position that owns ``mb`` to the one of the receiving position that owns it.
    Local handoffs (zbv's turn of the V) stay on one rank, because every stage of a position is routed
    by the same rule. How a replica orders its own actions is `replica_rows`; `lower_replicated` adds
    the transfers.
    """

    counts: tuple[int, ...] = attrs.field(converter=_counts)

    @property
    def num_ranks(self) -> int:
        """Ranks of one pipeline replica (the table's positions with their replicas)."""
        return sum(self.counts)

    @property
    def uniform(self) -> bool:
        return len(set(self.counts)) == 1

    def first(self, position: int) -> int:
        """The rank of replica 0 of `position`."""
        return sum(self.counts[:position])

    def ranks(self, position: int) -> range:
        return range(self.first(position), self.first(position) + self.counts[position])

    def owner(self, position: int, microbatch: int) -> int:
        """Which replica of `position` runs `microbatch`."""
        return microbatch % self.counts[position]

    def rank_of(self, position: int, microbatch: int) -> int:
        return self.first(position) + self.owner(position, microbatch)

    def place(self, rank: int) -> tuple[int, int]:
        """(position, replica) of a rank of the replicated pipeline."""
        if not 0 <= rank < self.num_ranks:
            raise ScheduleError(f"rank {rank} is outside the {self.num_ranks} ranks of replicas {self.counts}")
        position = 0
        while rank >= self.counts[position]:
            rank, position = rank - self.counts[position], position + 1
        return position, rank

    def microbatches(self, rank: int, num_microbatches: int) -> tuple[int, ...]:
        """The microbatches a rank runs."""
        position, replica = self.place(rank)
        return tuple(mb for mb in range(num_microbatches) if self.owner(position, mb) == replica)

    def check(self, table: Table) -> None:
        """ScheduleError unless there is one count per table rank and each divides the microbatches."""
        self._check_ranks(table)
        m = table.num_microbatches
        uneven = [q for q, c in enumerate(self.counts) if m % c]
        if uneven:
            q = uneven[0]
            raise ScheduleError(f"{m} microbatches do not split evenly over the {self.counts[q]} replicas of pipeline "
                                f"rank {q}; use a microbatch count that every replica count divides (a multiple of "
                                f"{math.lcm(*self.counts)})")

    def _check_ranks(self, table: Table) -> None:
        if len(self.counts) != table.num_ranks:
            raise ScheduleError(f"replicas {self.counts} give {len(self.counts)} counts for a table of "
                                f"{table.num_ranks} ranks; give one count per pipeline rank")

    def row(self, table: Table, rank: int) -> tuple[Action, ...]:
        """The actions `rank` runs: its position's row, kept where it owns the microbatch."""
        position, replica = self.place(rank)
        return tuple(a for a in table.rows[position] if self.owner(position, a.microbatch) == replica)

    def rows(self, table: Table) -> tuple[tuple[Action, ...], ...]:
        """Every rank's actions (replicas of one position may run unequal shares here; `check` refuses that)."""
        self._check_ranks(table)
        return tuple(self.row(table, r) for r in range(self.num_ranks))

    def peer(self, table: Table, action: Action) -> int:
        """The rank on the other end of a communication action."""
        stage = action.peer_stage
        if stage is None:
            raise ScheduleError(f"{action} is not a communication action")
        return self.rank_of(table.rank_of(stage), action.microbatch)

    def __str__(self) -> str:
        return "x".join(map(str, self.counts))


def replica_rows(build: Callable[[int], Table], num_microbatches: int, replicas: Replicas,
                 order: str = "split") -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions. ``build(m)`` is the schedule for m microbatches (of every position).

    ``split``: replica k runs its position's row of ``build(num_microbatches)``, kept where it owns the
    microbatch: the schedule's order, and always runnable (it only drops order between ranks). It thins
    the warm-up, though: a 1F1B position with 2 replicas keeps half its microbatches in flight on each.
    ``own``: replica k runs its position's row of ``build(num_microbatches / count)`` as a schedule of
    its own microbatches (local i is microbatch ``k + i * count``): each replica warms up as a whole
    position would, which is what 1F1B and ZB-H1 need (near GPipe's time at 1F1B's memory), while
    interleaved schedules lose their interleaving; the planner simulates both and keeps the faster.
    ScheduleError when ``own`` cannot be built or its rows cannot finish (then use ``split``).
    """
    if order not in ORDERS:
        raise ScheduleError(f"replica order must be one of {ORDERS}, got {order!r}")
    table = build(num_microbatches)
    replicas.check(table)
    if order == "split":
        return tuple(tuple(a for a in row if a.is_compute) for row in replicas.rows(table))
    try:
        own = {c: build(num_microbatches // c) for c in set(replicas.counts)}
        rows = tuple(_own_row(own, replicas, rank) for rank in range(replicas.num_ranks))
        simulate_replicated(table, replicas, rows=rows)  # raises when they cannot finish
    except ScheduleError as err:
        raise ScheduleError(f"the 'own' replica order does not run for replicas {replicas} and "
                            f"{num_microbatches} microbatches ({err}); use the 'split' order") from err
    return rows


def _own_row(own: dict[int, Table], replicas: Replicas, rank: int) -> tuple[Action, ...]:
    """Replica k of a position with c replicas: the position's row for its own share, local i as k + i * c."""
    q, k = replicas.place(rank)
    c = replicas.counts[q]
    return tuple(Action(a.stage, a.kind, k + a.microbatch * c) for a in own[c].rows[q] if a.is_compute)


def _messages(table: Table, a: Action) -> tuple[list[Action], list[Action]]:
    """The receives a compute action needs before it, and the sends it makes after it (across positions)."""
    s, mb, place, last = a.stage, a.microbatch, table.stage_to_rank, table.num_stages - 1
    if a.kind == F:
        return ([Action(s, RECV_F, mb)] if s > 0 and place[s - 1] != place[s] else [],
                [Action(s, SEND_F, mb)] if s < last and place[s + 1] != place[s] else [])
    if a.kind in (B, BW):
        return ([Action(s, RECV_B, mb)] if s < last and place[s + 1] != place[s] else [],
                [Action(s, SEND_B, mb)] if s > 0 and place[s - 1] != place[s] else [])
    return [], []


def lower_replicated(table: Table, replicas: Replicas,
                     rows: Sequence[Sequence[Action]]) -> tuple[tuple[Action, ...], ...]:
    """`rows` (compute only, from `replica_rows`) with their transfers: each send right after what it
    sends; each receive before what needs it, and on each ordered pair of ranks in the order of the sends
    (a receive moves earlier when a later-sent message is needed first). The runtime never waits on a
    send and each pair of ranks is a FIFO channel, so rows that `simulate_replicated` runs to the end
    cannot deadlock and every receive gets the message it names."""
    simulate_replicated(table, replicas, rows=rows)
    sent: dict[tuple[int, int], list[Action]] = {}
    for rank, row in enumerate(rows):
        for a in row:
            for send in _messages(table, a)[1]:
                sent.setdefault((rank, replicas.peer(table, send)), []).append(send.partner())
    need: dict[Action, int] = {}
    for row in rows:
        for t, a in enumerate(row):
            need.update((r, t) for r in _messages(table, a)[0])
    before: dict[int, dict[int, list[Action]]] = {}
    for (src, dst), order in sent.items():
        due = len(rows[dst])
        for receive in reversed(order):  # each receive no later than the next one sent on this channel
            due = min(due, need[receive])
            before.setdefault(dst, {}).setdefault(due, []).insert(0, receive)
    return tuple(_with_messages(table, row, before.get(rank, {})) for rank, row in enumerate(rows))


def _with_messages(table: Table, row: Sequence[Action], before: dict[int, list[Action]]) -> tuple[Action, ...]:
    out: list[Action] = []
    for t, a in enumerate(row):
        out += before.get(t, [])
        out.append(a)
        out += _messages(table, a)[1]
    return tuple(out)


@attrs.frozen(eq=False)
class RoutedRun:
    """A replicated table's run: step time, idle share, and per stage its most microbatches live on one replica."""

    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    stage_peak_live: tuple[int, ...]
    peak_memory: tuple[float, ...]


def _dependencies(table: Table, a: Action) -> list[tuple[int, str, int, int]]:
    """(stage, F or B, microbatch, crossed boundary or -1) that action `a` waits for (B: the input grad,
    from B or BW)."""
    s, mb, place = a.stage, a.microbatch, table.stage_to_rank
    if a.kind == F:
        return [] if s == 0 else [(s - 1, F, mb, s - 1 if place[s - 1] != place[s] else -1)]
    if a.kind == W:
        return [(s, B, mb, -1)]
    deps = [(s, F, mb, -1)]
    if s + 1 < table.num_stages:
        deps.append((s + 1, B, mb, s if place[s + 1] != place[s] else -1))
    return deps


def simulate_replicated(table: Table, replicas: Replicas, costs: Costs | None = None, *,
                        rows: Sequence[Sequence[Action]] | None = None) -> RoutedRun:
    """Run each rank's compute actions (`rows`, default `replicas.rows(table)`) in order, each as soon as its
    inputs are there, paying the transfer time on every dependency between ranks (as ``simulate`` does for
    unlowered tables; with one replica everywhere and no `rows` it is that run, host included: costs with
    ``issue_*`` give each rank a host that walks its row ahead of its device, as ``execute`` does). ScheduleError
    when the rows cannot finish."""
    costs = Costs() if costs is None else costs
    costs.check(table.num_stages, table.num_ranks)
    rows = [[a for a in row if a.is_compute] for row in (replicas.rows(table) if rows is None else rows)]
    end: dict[tuple[int, str, int], float] = {}
    waiters: dict[tuple[int, str, int], list[int]] = {}
    pos, clock = [0] * len(rows), [0.0] * len(rows)
    host, sent, sends = [0.0] * len(rows), {}, _sends(table, rows, costs) if costs.hosted else {}
    queue = deque(range(len(rows)))
    while queue:
        r = queue.popleft()
        while pos[r] < len(rows[r]):
            a = rows[r][pos[r]]
            deps = _dependencies(table, a)
            missing = next(((s, k, mb) for s, k, mb, _ in deps if (s, k, mb) not in end), None)
            if missing is not None:
                waiters.setdefault(missing, []).append(r)
                break
            issued = host[r] + sum(costs.transfer_issue(x) for *_, x in deps if x >= 0)  # the receives' posts
            ready = max([clock[r], issued, *(max(end[(s, k, mb)], sent.get((s, k, mb), 0.0)) + costs.transfer_time(x)
                                             if x >= 0 else end[(s, k, mb)] for s, k, mb, x in deps)])
            key = (a.stage, B if a.kind == BW else a.kind, a.microbatch)
            host[r] = issued + costs.issue_time(a)
            end[key] = clock[r] = max(ready + costs.compute_time(a), host[r])
            host[r] = sent[key] = host[r] + sends.get(key, 0.0)
            pos[r] += 1
            queue.extend(waiters.pop(key, ()))
    stuck = [r for r, row in enumerate(rows) if pos[r] < len(row)]
    if stuck:
        raise ScheduleError(f"the replicated rows {replicas} cannot finish: ranks {stuck} wait at "
                            f"{[str(rows[r][pos[r]]) for r in stuck]}; the table's order is not a valid schedule")
    return _run(table, replicas, rows, costs, max([0.0, *clock]))


def _sends(table: Table, rows: list[list[Action]], costs: Costs) -> dict[tuple[int, str, int], float]:
    """Host seconds each compute's sends take to post: one post per consumer on another rank."""
    out: dict[tuple[int, str, int], float] = {}
    for a in (a for row in rows for a in row):
        for s, k, mb, x in _dependencies(table, a):
            if x >= 0:
                out[(s, k, mb)] = out.get((s, k, mb), 0.0) + costs.transfer_issue(x)
    return out


def _run(table: Table, replicas: Replicas, rows: list[list[Action]], costs: Costs, makespan: float) -> RoutedRun:
    busy = tuple(sum(costs.compute_time(a) for a in row) for row in rows)
    total = makespan * len(rows)
    live, memory = [0] * table.num_stages, []
    for r, row in enumerate(rows):
        peak, top = _walk(row, costs, costs.static(replicas.place(r)[0]))
        memory.append(peak)
        for s, n in top.items():
            live[s] = max(live[s], n)
    return RoutedRun(makespan, busy, (total - sum(busy)) / total if total > 0 else 0.0, tuple(live), tuple(memory))


def _walk(row: list[Action], costs: Costs, static: float) -> tuple[float, dict[int, int]]:
    """A rank's peak bytes and, per stage, its most microbatches live (F opens one, BW or W closes it)."""
    memory = peak = static
    now: dict[int, int] = {}
    top: dict[int, int] = {}
    for a in row:
        at_start, at_end = costs.memory_delta(a)
        now[a.stage] = now.get(a.stage, 0) + (a.kind == F)
        top[a.stage] = max(top.get(a.stage, 0), now[a.stage])
        memory += at_start
        peak = max(peak, memory)
        memory += at_end
        now[a.stage] -= a.kind in (BW, W)
    return peak, top
