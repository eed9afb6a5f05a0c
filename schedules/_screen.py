"""_screen: a fast pass that clears a well-formed table, so validation explains only failures."""

from __future__ import annotations

from operator import attrgetter, gt, itemgetter, lt

from schedules.action import BW, RECV_B, RECV_F, SEND_B, SEND_F, B, F, W
from schedules.index import TableIndex

__all__ = ["well_formed"]

_STAGE = attrgetter("stage")
_COMM = ((0, SEND_F), (1, RECV_F), (1, SEND_B), (0, RECV_B))  # (offset from the boundary, kind)


def well_formed(ix: TableIndex) -> bool:
    """True only when every structural check of ``validate`` would pass.

    It works a stage and a kind at a time on ``ix.ids``: with no repeats, every expected action
    present and no others (the counts agree), each on its stage's rank, ranges, completeness
    and pairing hold; the order checks compare the steps of whole slices. False means "not
    cleared": the checks then run one by one and explain.
    """
    if ix.dense is None or not _placed(ix):
        return False
    return _expected_count(ix) == len(ix.actions) and _in_order(ix) and _received_in_order(ix)


def _placed(ix: TableIndex) -> bool:
    """Every action runs on the rank holding its stage."""
    homes: list[set[int]] = [set() for _ in ix.table.rows]
    for stage, rank in enumerate(ix.table.stage_to_rank):
        homes[rank].add(stage)
    return all(set(map(_STAGE, row)) <= home for row, home in
               zip(ix.table.rows, homes, strict=True))


def _expected_count(ix: TableIndex) -> int:
    """How many actions a complete table of these stages has; -1 when one is missing."""
    m, count = ix.table.num_microbatches, 0
    for s in range(ix.table.num_stages):
        fused, split, weight = ix.ids(s, BW), ix.ids(s, B), ix.ids(s, W)
        if -1 in ix.ids(s, F):
            return -1
        all_fused = -1 not in fused and split.count(-1) == weight.count(-1) == m
        all_split = fused.count(-1) == m and -1 not in split and -1 not in weight
        if not (all_fused or all_split or all(
                (f >= 0) != (b >= 0) and (b >= 0) == (w >= 0)  # BW, or both B and W
                for f, b, w in zip(fused, split, weight, strict=True))):
            return -1
        count += 2 * m + fused.count(-1)  # BW, or B and W
    if ix.lowered:
        for s in ix.crossings():
            if any(-1 in ix.ids(s + offset, kind) for offset, kind in _COMM):
                return -1
            count += 4 * m
    return count


def _steps(ix: TableIndex, ids: list[int]) -> list[int]:
    return list(map(ix.step.__getitem__, ids))


def _in_order(ix: TableIndex) -> bool:
    """Every input produced or received on an action's own rank comes before it in the row."""
    place, last, lowered = ix.table.stage_to_rank, ix.table.num_stages - 1, ix.lowered
    for s in range(last + 1):
        below = s > 0 and place[s - 1] != place[s]  # stage s - 1 is on another rank
        above = s < last and place[s + 1] != place[s]
        forward, backward = _steps(ix, ix.ids(s, F)), _steps(ix, ix.backward_ids(s))
        before = [(forward, backward)]  # (earlier, later) step pairs
        weights = ix.ids(s, W)
        if weights.count(-1) != len(weights):
            before += [([ix.step[b] for b, w in zip(ix.ids(s, B), weights, strict=True)
                         if w >= 0],
                        [ix.step[w] for w in weights if w >= 0])]
        if s > 0 and (not below or lowered):
            before.append((_steps(ix, ix.ids(s, RECV_F) if below else ix.ids(s - 1, F)), forward))
        if s < last and (not above or lowered):
            before.append((_steps(ix, ix.ids(s, RECV_B) if above else ix.backward_ids(s + 1)),
                           backward))
        if lowered and above:
            before.append((forward, _steps(ix, ix.ids(s, SEND_F))))
        if lowered and below:
            before.append((backward, _steps(ix, ix.ids(s, SEND_B))))
        if not all(all(map(lt, earlier, later)) for earlier, later in before):
            return False
    return True


def _received_in_order(ix: TableIndex) -> bool:
    """Between two ranks, the receives come in the order of the sends."""
    if not ix.lowered:
        return True
    place = ix.table.stage_to_rank
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s in ix.crossings():
        pairs.setdefault((place[s], place[s + 1]), []).extend(
            zip(_steps(ix, ix.ids(s, SEND_F)), _steps(ix, ix.ids(s + 1, RECV_F)), strict=True))
        pairs.setdefault((place[s + 1], place[s]), []).extend(
            zip(_steps(ix, ix.ids(s + 1, SEND_B)), _steps(ix, ix.ids(s, RECV_B)), strict=True))
    for messages in pairs.values():
        messages.sort()
        received = list(map(itemgetter(1), messages))
        if any(map(gt, received, received[1:])):
            return False
    return True
