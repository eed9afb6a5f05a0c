"""validate: hand-made broken tables fail with the numbers, the fix and the action marked."""

from __future__ import annotations

import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_cases import build, cases

import schedules
from schedules import Action, ScheduleError, Table
from schedules.index import TableIndex
from schedules.validate import check_structure


def _error(table: Table) -> str:
    with pytest.raises(ScheduleError) as caught:
        schedules.validate(table)
    return str(caught.value)


def test_missing_w() -> None:
    message = _error(Table.from_rows([["0F0", "0B0", "0F1", "0B1", "0W1"]]))
    assert message.startswith("0B0 (rank 0, step 1) has no matching 0W0; add 0W0 on rank 0\n")
    assert "[0B0]" in message


def test_b_before_f() -> None:
    message = _error(Table.from_rows([["0B0", "0F0", "0W0"]]))
    assert message == (
        "0B0 (rank 0, step 0) needs 0F0, which comes later on the same rank (step 1); "
        "move 0F0 before 0B0\n"
        "   0    1    2\n"
        "r0[0B0][0F0] 0W0"
    )


def test_w_before_b() -> None:
    assert "0W0 (rank 0, step 1) needs 0B0, which comes later" in _error(
        Table.from_rows([["0F0", "0W0", "0B0"]]))


def test_impossible_cross_rank_dependency() -> None:
    table = Table.from_rows([["0F0", "0BW0", "0F1", "0BW1"], ["1F1", "1BW1", "1F0", "1BW0"]])
    message = _error(table)
    assert message.startswith(
        "deadlock: 2 of 2 ranks can never finish: rank 0 waits at 0BW0 for rank 1 to finish "
        "1BW0; rank 1 waits at 1F1 for rank 0 to finish 0F1; reorder the rows"
    )
    assert "r0 0F0  [0BW0][0F1]  0BW1" in message
    assert "r1[1F1]  1BW1  1F0  [1BW0]" in message


@pytest.mark.parametrize(("rows", "placement", "message", "mark"), [
    ([["0F0", "1F0", "1BW0", "0BW0"], []], [0, 1],
     "1F0 (rank 0, step 1) runs on rank 0 but stage 1 lives on rank 1; move it to rank 1's row",
     "[1F0]"),
    ([["0F0", "0BW0", "0F0"]], None, "0F0 appears twice, at 0F0 (rank 0, step 0) and 0F0 "
     "(rank 0, step 2); remove one", "[0F0]"),
    ([["0BW0"]], [0], "stage 0 microbatch 0 has no forward; add 0F0 on rank 0", "[0BW0]"),
    ([["0F0"]], [0], "stage 0 microbatch 0 has no backward; add 0BW0 (or 0B0 and 0W0) after "
     "0F0 on rank 0", "[0F0]"),
    ([["0F0", "0B0", "0BW0", "0W0"]], None, "stage 0 microbatch 0 has both 0BW0 and 0B0; keep "
     "BW alone or B and W", "[0BW0]"),
    ([["0F0", "0W0"]], None, "0W0 (rank 0, step 1) has no matching 0B0", "[0W0]"),
    ([["0F0", "0BW0", "3F0"]], [0], "3F0 (rank 0, step 2) names stage 3 but the table has 1 "
     "stages (0..0)", "[3F0]"),
])
def test_structural_errors(rows: list[list[str]], placement: list[int] | None, message: str,
                           mark: str) -> None:
    got = _error(Table.from_rows(rows, stage_to_rank=placement))
    assert got.startswith(message)
    assert mark in got


def test_microbatch_out_of_range() -> None:
    table = Table.from_rows([["0F0", "0BW0", "0F1", "0BW1"]], num_microbatches=1)
    assert "0F1 (rank 0, step 2) names microbatch 1 but the table has 1" in _error(table)


LOWERED = [
    ["0F0", "0SEND_F0", "0RECV_B0", "0BW0"],
    ["1RECV_F0", "1F0", "1BW0", "1SEND_B0"],
]


def test_hand_lowered_table_is_valid() -> None:
    schedules.validate(Table.from_rows(LOWERED))


def test_missing_receive() -> None:
    rows = [LOWERED[0], [a for a in LOWERED[1] if a != "1RECV_F0"]]
    message = _error(Table.from_rows(rows))
    assert message.startswith("0SEND_F0 (rank 0, step 1) has no matching 1RECV_F0 on rank 1")
    assert "[0SEND_F0]" in message


def test_missing_pair() -> None:
    rows = [["0F0", "0RECV_B0", "0BW0"], ["1F0", "1BW0", "1SEND_B0"]]
    message = _error(Table.from_rows(rows))
    assert message.startswith("the lowered table lacks 0SEND_F0: stages 0 and 1 are on ranks 0 "
                              "and 1; lower the unlowered table with schedules.lower or add it")
    assert "[0F0]" in message


def test_communication_between_stages_of_one_rank() -> None:
    rows = [["0F0", "0SEND_F0", "1RECV_F0", "1F0", "1BW0", "0BW0"]]
    message = _error(Table.from_rows(rows, stage_to_rank=[0, 0]))
    assert "0SEND_F0 (rank 0, step 1) exchanges between stages 0 and 1, both on rank 0" in message


def test_send_before_its_data() -> None:
    rows = [["0SEND_F0", "0F0", "0RECV_B0", "0BW0"], LOWERED[1]]
    assert "0SEND_F0 (rank 0, step 0) needs 0F0, which comes later" in _error(Table.from_rows(rows))


def test_receives_out_of_issue_order() -> None:
    rows = [
        ["0F0", "0F1", "0SEND_F0", "0SEND_F1", "0RECV_B0", "0BW0", "0RECV_B1", "0BW1"],
        ["1RECV_F1", "1RECV_F0", "1F0", "1BW0", "1SEND_B0", "1F1", "1BW1", "1SEND_B1"],
    ]
    message = _error(Table.from_rows(rows))
    assert message.startswith(
        "rank 0's send #0 to rank 1 is 0SEND_F0 but rank 1's receive #0 from rank 0 is 1RECV_F1; "
        "NCCL pairs messages between two ranks in issue order")
    assert "[0SEND_F0]" in message and "[1RECV_F1]" in message


DEADLOCKING = [  # rank 0 waits for grad 0 before sending forward 1, which rank 1 needs first
    ["0F0", "0SEND_F0", "0F1", "0RECV_B0", "0BW0", "0SEND_F1", "0RECV_B1", "0BW1"],
    ["1RECV_F0", "1F0", "1RECV_F1", "1F1", "1BW0", "1SEND_B0", "1BW1", "1SEND_B1"],
]


def test_simulate_detects_a_rendezvous_deadlock_fast() -> None:
    table = Table.from_rows(DEADLOCKING)
    began = time.perf_counter()
    with pytest.raises(ScheduleError) as caught:
        schedules.simulate(table)
    assert time.perf_counter() - began < 1.0
    message = str(caught.value)
    assert message.startswith(
        "deadlock: 2 of 2 ranks can never finish: rank 0 waits at 0RECV_B0 for rank 1 to post "
        "1SEND_B0; rank 1 waits at 1RECV_F1 for rank 0 to post 0SEND_F1; pair the communication")
    assert "[0RECV_B0]" in message and "[1RECV_F1]" in message
    assert "deadlock" in _error(table)  # validate runs the same check


def test_lowering_the_same_order_pairs_it_deadlock_free() -> None:
    compute = [[a for a in row if "SEND" not in a and "RECV" not in a] for row in DEADLOCKING]
    lowered = schedules.lower(Table.from_rows(compute))
    schedules.validate(lowered)
    assert schedules.simulate(lowered).makespan == schedules.simulate(
        Table.from_rows(compute)).makespan


def test_deadlock_in_a_big_lowered_table_is_found_within_a_second() -> None:
    lowered = schedules.lower(schedules.one_f_one_b(16, 64))
    rows = [list(row) for row in lowered.rows]
    first = rows[0]
    first.insert(2, first.pop(first.index(Action(0, "RECV_B", 0))))  # grad 0 awaited too early
    broken = Table(lowered.num_stages, lowered.num_microbatches, lowered.stage_to_rank, rows)
    began = time.perf_counter()
    with pytest.raises(ScheduleError, match="deadlock"):
        schedules.simulate(broken)
    assert time.perf_counter() - began < 1.0


def _mutated(table: Table, edits: list[tuple[int, int, int, int, int]]) -> Table:
    """``table`` after edits (kind, rank, step, other rank, value): swap, move, drop, repeat or
    add an action, possibly out of range or of a kind the table does not use."""
    rows = [list(row) for row in table.rows]
    for kind, rank, step, other, value in edits:
        row, target = rows[rank % len(rows)], rows[other % len(rows)]
        at = step % len(row) if row else 0
        if kind == 0 and len(row) > 1:
            row[at], row[(at + value) % len(row)] = row[(at + value) % len(row)], row[at]
        elif kind == 1 and row:
            target.insert(value % (len(target) + 1), row.pop(at))
        elif kind == 2 and row:
            row.pop(at)
        elif kind == 3 and row:
            target.insert(value % (len(target) + 1), row[at])
        elif kind == 4:
            made = Action(value % (table.num_stages + 1), schedules.KINDS[value % 8],
                          (value // 8) % (table.num_microbatches + 1))
            target.insert(step % (len(target) + 1), made)
    return Table(table.num_stages, table.num_microbatches, table.stage_to_rank, rows)


def _explained(check: object, table: Table) -> str | None:
    try:
        check(table)  # type: ignore[operator]
    except ScheduleError as error:
        return str(error)
    return None


def _every_check(table: Table) -> None:
    validate_module = sys.modules["schedules.validate"]
    index = TableIndex(table)
    for check in validate_module._CHECKS:
        check(index)


@settings(max_examples=300, deadline=None)
@given(cases(), st.booleans(), st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 7), st.integers(0, 400), st.integers(0, 7),
              st.integers(0, 400)), min_size=1, max_size=3))
def test_fast_screen_never_hides_an_error(case: tuple[str, int, int, dict[str, int]],
                                          lowered: bool,
                                          edits: list[tuple[int, int, int, int, int]]) -> None:
    """``check_structure`` clears well-formed tables in one fast pass and runs the checks one by
    one otherwise: it must raise exactly what the checks alone raise."""
    table = build(*case)
    table = _mutated(schedules.lower(table) if lowered else table, edits)
    assert _explained(check_structure, table) == _explained(_every_check, table)


@settings(max_examples=60, deadline=None)
@given(cases(), st.booleans())
def test_valid_tables_take_the_fast_screen(case: tuple[str, int, int, dict[str, int]],
                                           lowered: bool) -> None:
    table = build(*case)
    assert sys.modules["schedules._screen"].well_formed(
        TableIndex(schedules.lower(table) if lowered else table))


def test_a_table_of_empty_rows_is_refused_as_a_schedule_error() -> None:
    empty = Table(rows=((), ()), stage_to_rank=(0, 1), num_stages=2, num_microbatches=1)
    with pytest.raises(ScheduleError, match=r"0F0"):
        schedules.validate(empty)
