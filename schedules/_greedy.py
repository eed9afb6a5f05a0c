"""Greedy list scheduling with unit F = B = W times, shared by the zero-bubble schedules."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from schedules.action import Action, B, F, W
from schedules.table import Table

__all__ = ["greedy_table"]

Priority = Callable[[Action], tuple[int, ...]]


class _State:
    """Progress of the greedy run: what each stage does next and when each action ended."""

    def __init__(self, num_stages: int) -> None:
        self.next = {kind: [0] * num_stages for kind in (F, B, W)}
        self.ended: dict[tuple[int, str, int], int] = {}

    def done(self, stage: int, kind: str, microbatch: int, now: int) -> bool:
        return self.ended.get((stage, kind, microbatch), now + 1) <= now


def _candidates(state: _State, stages: Sequence[int], last: int, m: int, now: int,
                may_forward: bool) -> list[Action]:
    found = []
    for s in stages:
        i = state.next[F][s]
        if may_forward and i < m and (s == 0 or state.done(s - 1, F, i, now)):
            found.append(Action(s, F, i))
        i = state.next[B][s]
        if i < m and state.done(s, F, i, now) and (s == last or state.done(s + 1, B, i, now)):
            found.append(Action(s, B, i))
        i = state.next[W][s]
        if i < m and state.done(s, B, i, now):
            found.append(Action(s, W, i))
    return found


def greedy_table(
    stage_to_rank: Sequence[int], num_microbatches: int, *, live_limit: Sequence[int],
    priority: Priority,
) -> Table:
    """Each time unit, every idle rank starts its most urgent ready action (lowest ``priority``).

    Microbatches pass each stage in order; a rank starts a forward only while it holds fewer
    than ``live_limit[rank]`` stage-microbatches (live from F until W).
    """
    num_stages, num_ranks = len(stage_to_rank), max(stage_to_rank) + 1
    stages = [[s for s in range(num_stages) if stage_to_rank[s] == r] for r in range(num_ranks)]
    state, live = _State(num_stages), [0] * num_ranks
    rows: list[list[Action]] = [[] for _ in range(num_ranks)]
    remaining, now = 3 * num_stages * num_microbatches, 0
    while remaining:
        for r in range(num_ranks):
            found = _candidates(state, stages[r], num_stages - 1, num_microbatches, now,
                                live[r] < live_limit[r])
            if found:
                action = min(found, key=priority)
                rows[r].append(action)
                state.next[action.kind][action.stage] += 1
                state.ended[(action.stage, action.kind, action.microbatch)] = now + 1
                live[r] += (action.kind == F) - (action.kind == W)
                remaining -= 1
        now += 1
        assert now <= 6 * num_stages * num_microbatches + num_stages, "greedy schedule stalled"
    return Table(num_stages, num_microbatches, tuple(stage_to_rank), rows)
