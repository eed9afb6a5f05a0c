"""lower: where messages go, how they group, and what it refuses."""

from __future__ import annotations

import pytest

import schedules
from schedules import Action, Costs, ScheduleError, Table

LOWERED_1F1B_2x3 = (
    "   0        1        2        3        4        5        6        7        8        9"
    "        10       11\n"
    "r0 0F0      0SEND_F0 0F1      0SEND_F1 0RECV_B0 0BW0     0F2      0SEND_F2 0RECV_B1 0BW1"
    "     0RECV_B2 0BW2\n"
    "r1 1RECV_F0 1F0      1BW0     1RECV_F1 1SEND_B0 1F1      1BW1     1RECV_F2 1SEND_B1 1F2"
    "      1BW2     1SEND_B2"
)


def test_golden_1f1b() -> None:
    assert str(schedules.lower(schedules.one_f_one_b(2, 3))) == LOWERED_1F1B_2x3


def _groups(row: tuple[Action, ...]) -> list[set[str]]:
    groups: list[set[str]] = [set()]
    for action in row:
        if action.is_comm:
            groups[-1].add(action.kind)
        elif groups[-1]:
            groups.append(set())
    return [g for g in groups if g]


def test_1f1b_steady_state_pairs_like_megatron() -> None:
    lowered = schedules.lower(schedules.one_f_one_b(4, 8))
    middle = _groups(lowered.rows[1])
    assert {"SEND_F", "RECV_B"} in middle  # send_forward_recv_backward
    assert {"SEND_B", "RECV_F"} in middle  # send_backward_recv_forward
    # each send follows the compute producing it directly (after that compute's own group)
    for rank, row in enumerate(lowered.rows):
        for step, action in enumerate(row):
            if action.kind == "SEND_F":
                producer = row.index(Action(action.stage, "F", action.microbatch))
                assert all(a.is_comm for a in row[producer + 1:step]), (rank, step)


def test_stages_sharing_a_rank_exchange_nothing() -> None:
    one_rank = schedules.interleaved_1f1b(4, 2, stages_per_rank=4)
    assert schedules.lower(one_rank) == one_rank
    zbv = schedules.lower(schedules.zbv(6, 4))
    boundary = {(a.stage, a.peer_stage) for row in zbv.rows for a in row if a.is_comm}
    assert (2, 3) not in boundary and (3, 2) not in boundary  # stages 2 and 3 share rank 2
    assert (1, 2) in boundary and (4, 3) in boundary


def test_lowering_twice_is_refused() -> None:
    with pytest.raises(ScheduleError, match="already holds communication actions"):
        schedules.lower(schedules.lower(schedules.gpipe(2, 2)))


def test_lowering_checks_the_table_first() -> None:
    with pytest.raises(ScheduleError, match="has no matching 0W0"):
        schedules.lower(Table.from_rows([["0F0", "0B0"]]))


def test_reference_costs_must_be_positive() -> None:
    with pytest.raises(ScheduleError, match=r"needs positive compute times; 0W0 costs 0\.0"):
        schedules.lower(schedules.zb_h1(2, 2), costs=Costs.uniform(1, 1, 0))


def test_tuned_costs_keep_lowering_free_for_those_costs() -> None:
    costs = Costs(forward=(1, 3, 2), backward_input=(2, 5, 1), backward_weight=(1, 1, 2))
    table = schedules.zb_h1(3, 6)
    lowered = schedules.lower(table, costs=costs)
    schedules.validate(lowered)
    assert schedules.simulate(lowered, costs).makespan == schedules.simulate(table, costs).makespan
