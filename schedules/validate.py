"""validate: check that a table is complete, well placed and can run to the end."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from schedules._screen import well_formed
from schedules.action import BW, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W
from schedules.errors import ScheduleError
from schedules.execute import execute
from schedules.index import TableIndex
from schedules.table import Table

__all__ = ["check_structure", "validate"]


def validate(table: Table) -> None:
    """Raise ScheduleError, with the rank x step grid and the failing action marked ``[0B1]``,
    unless:

    every (stage, microbatch) has one F and either one BW or one B and one W; each action runs on
    the rank holding its stage; F comes before B before W; every action's inputs can be produced
    before it (no cycle through the per-rank order). For lowered tables also: every transfer
    between ranks has one send and one receive, sends go after what they send and receives
    before what needs them, each pair of ranks receives in the order it sends (NCCL matches
    point-to-point messages in issue order), and the communication groups cannot deadlock.
    """
    index = check_structure(table)
    execute(index, [1.0] * len(index.actions), [0.0] * table.num_stages)


def check_structure(table: Table) -> TableIndex:
    """All checks of ``validate`` except running the table; returns the index for reuse."""
    index = TableIndex(table)
    if not well_formed(index):  # the checks below find and explain what is wrong
        for check in _CHECKS:
            check(index)
    return index


def _fail(ix: TableIndex, message: str, ids: Iterable[int]) -> ScheduleError:
    marks = {(ix.rank[k], ix.step[k]) for k in ids}
    return ScheduleError(f"{message}\n{ix.table.to_grid(marks, crop=True)}")


def _where(ix: TableIndex, k: int) -> str:
    return f"{ix.actions[k]} (rank {ix.rank[k]}, step {ix.step[k]})"


def _check_ranges(ix: TableIndex) -> None:
    t = ix.table
    for k, a in enumerate(ix.actions):
        peer = a.peer_stage
        if a.stage >= t.num_stages or (peer is not None and not 0 <= peer < t.num_stages):
            raise _fail(ix, f"{_where(ix, k)} names stage {max(a.stage, peer or 0)} but the "
                        f"table has {t.num_stages} stages (0..{t.num_stages - 1})", [k])
        if a.microbatch >= t.num_microbatches:
            raise _fail(ix, f"{_where(ix, k)} names microbatch {a.microbatch} but the table has "
                        f"{t.num_microbatches}; raise num_microbatches or fix the action", [k])


def _check_placement(ix: TableIndex) -> None:
    for k, a in enumerate(ix.actions):
        home = ix.table.stage_to_rank[a.stage]
        if ix.rank[k] != home:
            raise _fail(ix, f"{_where(ix, k)} runs on rank {ix.rank[k]} but stage {a.stage} "
                        f"lives on rank {home}; move it to rank {home}'s row", [k])


def _check_duplicates(ix: TableIndex) -> None:
    for k in ix.duplicates:
        a = ix.actions[k]
        first = ix.id_of[(a.stage, a.kind, a.microbatch)]
        raise _fail(ix, f"{a} appears twice, at {_where(ix, first)} and {_where(ix, k)}; "
                    "remove one", [first, k])


def _check_backward(ix: TableIndex, stage: int, mb: int, forward: int) -> None:
    b, w, bw = (ix.find(stage, kind, mb) for kind in (B, W, BW))
    rank = ix.table.stage_to_rank[stage]
    if bw is not None and (b is not None or w is not None):
        other = b if b is not None else w
        assert other is not None
        raise _fail(ix, f"stage {stage} microbatch {mb} has both {ix.actions[bw]} and "
                    f"{ix.actions[other]}; keep BW alone or B and W", [bw, other])
    if bw is None and b is None and w is None:
        raise _fail(ix, f"stage {stage} microbatch {mb} has no backward; add {stage}BW{mb} (or "
                    f"{stage}B{mb} and {stage}W{mb}) after {stage}F{mb} on rank {rank}", [forward])
    if bw is None and (b is None) != (w is None):
        have, need = (b, Action(stage, W, mb)) if w is None else (w, Action(stage, B, mb))
        assert have is not None
        raise _fail(ix, f"{_where(ix, have)} has no matching {need}; add {need} on rank {rank}",
                    [have])


def _check_complete(ix: TableIndex) -> None:
    t = ix.table
    for stage in range(t.num_stages):
        for mb in range(t.num_microbatches):
            forward = ix.find(stage, F, mb)
            if forward is None:
                later = (ix.backward(stage, mb), ix.find(stage, W, mb))
                others = [k for k in later if k is not None]
                raise _fail(ix, f"stage {stage} microbatch {mb} has no forward; add {stage}F{mb} "
                            f"on rank {t.stage_to_rank[stage]}", others)
            _check_backward(ix, stage, mb, forward)


def _check_comm_pairs(ix: TableIndex) -> None:
    for k, a in enumerate(ix.actions):
        if not a.is_comm:
            continue
        peer = a.peer_stage
        assert peer is not None
        if not ix.crosses(a.stage, peer):
            raise _fail(ix, f"{_where(ix, k)} exchanges between stages {a.stage} and {peer}, both "
                        f"on rank {ix.rank[k]}; remove it: stages on one rank need no "
                        "communication", [k])
        if ix.partner(k) is None:
            raise _fail(ix, f"{_where(ix, k)} has no matching {a.partner()} on rank "
                        f"{ix.table.stage_to_rank[peer]}; add it there", [k])


def _check_comm_required(ix: TableIndex) -> None:
    if not ix.lowered:
        return
    t = ix.table
    for stage in range(t.num_stages - 1):
        if not ix.crosses(stage, stage + 1):
            continue
        for mb in range(t.num_microbatches):
            for s, kind in ((stage, SEND_F), (stage + 1, RECV_F), (stage + 1, SEND_B),
                            (stage, RECV_B)):
                if ix.find(s, kind, mb) is None:
                    near = ix.find(s, F, mb) if kind in (SEND_F, RECV_F) else ix.backward(s, mb)
                    assert near is not None, "completeness was checked first"
                    raise _fail(ix, f"the lowered table lacks {s}{kind}{mb}: stages {stage} and "
                                f"{stage + 1} are on ranks {t.stage_to_rank[stage]} and "
                                f"{t.stage_to_rank[stage + 1]}; lower the unlowered table with "
                                "schedules.lower or add it", [near])


def _check_local_order(ix: TableIndex) -> None:
    for k in range(len(ix.actions)):
        deps = ix.dependencies(k)
        assert deps is not None, "completeness was checked first"
        for d, _ in deps:
            if ix.rank[d] == ix.rank[k] and ix.step[d] > ix.step[k]:
                raise _fail(ix, f"{_where(ix, k)} needs {ix.actions[d]}, which comes later on "
                            f"the same rank (step {ix.step[d]}); move {ix.actions[d]} before "
                            f"{ix.actions[k]}", [k, d])


def _check_peer_order(ix: TableIndex) -> None:
    sends: dict[tuple[int, int], list[int]] = {}
    receives: dict[tuple[int, int], list[int]] = {}
    for k, a in enumerate(ix.actions):
        if a.is_comm:
            peer_rank = ix.table.stage_to_rank[a.peer_stage]  # type: ignore[index]
            pair = (ix.rank[k], peer_rank) if a.is_send else (peer_rank, ix.rank[k])
            (sends if a.is_send else receives).setdefault(pair, []).append(k)
    for (src, dst), sent in sends.items():
        matched = [ix.partner(k) for k in sent]
        for position, (expected, got) in enumerate(zip(matched, receives[(src, dst)], strict=True)):
            if expected != got:
                assert expected is not None
                raise _fail(ix, f"rank {src}'s send #{position} to rank {dst} is "
                            f"{ix.actions[sent[position]]} but rank {dst}'s receive #{position} "
                            f"from rank {src} is {ix.actions[got]}; NCCL pairs messages between "
                            "two ranks in issue order, so receive in the order of the sends",
                            [sent[position], got, expected])


_CHECKS: tuple[Callable[[TableIndex], None], ...] = (
    _check_ranges, _check_placement, _check_duplicates, _check_complete, _check_comm_pairs,
    _check_comm_required, _check_local_order, _check_peer_order,
)
