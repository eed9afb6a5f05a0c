"""lower: add the sends and receives a table needs between ranks, in a deadlock-free order."""

from __future__ import annotations

import attrs

from schedules._placer import Links, Placer
from schedules.action import COMPUTE_KINDS, RECV_B, RECV_F, SEND_B, SEND_F, Action, F
from schedules.costs import Costs
from schedules.errors import ScheduleError
from schedules.index import TableIndex
from schedules.table import Table
from schedules.validate import check_structure

__all__ = ["lower"]

def lower(table: Table, *, costs: Costs | None = None) -> Table:
    """Insert SEND/RECV actions for every dependency between stages on different ranks.

    The runtime's rendezvous semantics (see ``simulate``) need both ranks of a message to be
    between compute actions at once. Messages are placed in time order on a reference run of
    ``table`` (under ``costs``; default F = B = W = 1, free communication): each goes in the
    first gap after its producer that overlaps a gap of the receiver before its consumer, at the
    latest shared time, so the send follows the producing compute and the receive comes as late
    as that allows. Messages that meet in one gap form one group: that is how 1F1B's steady state
    pairs SEND_F with RECV_B. When no gaps overlap, the receiver waits in the gap before the
    action it would be running, and the run is updated for that wait (only the computes it
    delays are timed again, so lowering takes time about proportional to the table).
    Each rank posts its messages in the order they meet, so the lowered table cannot deadlock
    whatever the real costs, and each pair of ranks receives in the order of the sends.
    """
    if table.is_lowered:
        raise ScheduleError("the table already holds communication actions; lower the table "
                            "the schedule function returned, once")
    index = check_structure(table)
    costs = Costs() if costs is None else costs
    placer = Placer(index, _durations(index, costs), _links(index))
    placer.place_all()
    return _assemble(table, placer, index.crossings())


def _durations(index: TableIndex, costs: Costs) -> list[float]:
    costs.check(index.table.num_stages, index.table.num_ranks)
    times = {kind: [costs.compute_time(Action(s, kind, 0)) for s in range(index.table.num_stages)]
             for kind in COMPUTE_KINDS}
    duration = [times[a.kind][a.stage] for a in index.actions]
    for k, time in enumerate(duration):
        if not time > 0:
            raise ScheduleError(
                f"lower orders messages by a reference run and needs positive compute times; "
                f"{index.actions[k]} costs {time}: pass costs with times > 0 or none"
            )
    return duration


def _links(index: TableIndex) -> Links:
    """Every message between ranks: for each stage boundary between ranks (``crossings``) and
    each microbatch, message ``n`` = 2 (boundary x microbatches + microbatch) carries the
    activation forward and message ``n + 1`` its grad back."""
    producers: list[int] = []
    consumers: list[int] = []
    for stage in index.crossings():
        count = len(producers)
        producers += [0, 0] * index.table.num_microbatches
        consumers += [0, 0] * index.table.num_microbatches
        producers[count::2], consumers[count::2] = index.ids(stage, F), index.ids(stage + 1, F)
        producers[count + 1::2] = index.backward_ids(stage + 1)
        consumers[count + 1::2] = index.backward_ids(stage)
    rank, step = index.rank.__getitem__, index.step.__getitem__
    return Links(list(map(rank, producers)), list(map(step, producers)),
                 list(map(rank, consumers)), list(map(step, consumers)))


def _assemble(table: Table, placer: Placer, crossings: list[int]) -> Table:
    """The rows with each gap's messages in the order they meet (activations before grads at
    one time, then by boundary and microbatch): sends on the producer's rank, receives on the
    other."""
    m, meets, src = table.num_microbatches, placer.meeting_times(), placer.links.src
    sends: list[Action] = []
    receives: list[Action] = []
    for s in crossings:
        sends += [a for mb in range(m) for a in (Action(s, SEND_F, mb), Action(s + 1, SEND_B, mb))]
        receives += [a for mb in range(m)
                     for a in (Action(s + 1, RECV_F, mb), Action(s, RECV_B, mb))]

    def order(n: int) -> tuple[float, int, int, int]:
        return meets[n], n % 2, crossings[n // 2 // m], n // 2 % m

    rows = []
    for rank, row in enumerate(table.rows):
        out: list[Action] = []
        done = 0
        for step in sorted(placer.gaps[rank]):
            out += row[done:step]
            done, found = step, placer.members(rank, step)
            found.sort(key=order)
            out += [sends[n] if src[n] == rank else receives[n] for n in found]
        rows.append(out + list(row[done:]))
    return attrs.evolve(table, rows=rows)
