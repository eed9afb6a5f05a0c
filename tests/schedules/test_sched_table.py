"""Table: construction, printing, placement queries, JSON and the file formats."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from sched_cases import build, cases

import schedules
from schedules import Action, ScheduleError, Table

ONE_F_ONE_B_2x3 = (
    "   0    1    2    3    4    5\n"
    "r0 0F0  0F1  0BW0 0F2  0BW1 0BW2\n"
    "r1 1F0  1BW0 1F1  1BW1 1F2  1BW2"
)


def test_str_is_the_rank_by_step_grid() -> None:
    assert str(schedules.one_f_one_b(2, 3)) == ONE_F_ONE_B_2x3


def test_marked_grid_golden() -> None:
    table = schedules.one_f_one_b(2, 3)
    assert table.to_grid({(0, 1), (1, 2)}) == (
        "   0     1     2     3     4     5\n"
        "r0 0F0  [0F1]  0BW0  0F2   0BW1  0BW2\n"
        "r1 1F0   1BW0 [1F1]  1BW1  1F2   1BW2"
    )


def test_uneven_rows_print_blank_cells() -> None:
    table = Table.from_rows([["0F0", "0B0", "0W0"], []], stage_to_rank=[0])
    assert str(table) == "   0   1   2\nr0 0F0 0B0 0W0\nr1"


def test_repr_is_short() -> None:
    assert repr(schedules.gpipe(2, 3)) == (
        "Table(num_stages=2, num_microbatches=3, stage_to_rank=(0, 1), "
        "rows=<2 ranks, 12 actions>)"
    )


def test_placement_queries() -> None:
    table = schedules.zbv(6, 4)
    assert table.num_ranks == 3
    assert table.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert [table.stages_of(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]
    assert [table.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ScheduleError, match="stage 6 is out of range; the table has 6"):
        table.rank_of(6)
    assert not table.is_lowered and schedules.lower(table).is_lowered


def test_from_rows_infers_placement_and_counts() -> None:
    table = Table.from_rows(["0F0 0F1 2F0 2F1", "1F0 1F1 3F0 3F1"])
    assert (table.num_stages, table.num_microbatches) == (4, 2)
    assert table.stage_to_rank == (0, 1, 0, 1)
    assert table.rows[1][2] == Action(3, "F", 0)
    explicit = Table.from_rows([["0F0"], ["1F0"]], stage_to_rank=[1, 0], num_microbatches=3)
    assert (explicit.stage_to_rank, explicit.num_microbatches) == ((1, 0), 3)


@pytest.mark.parametrize(
    ("build_it", "message"),
    [
        (lambda: Table.from_rows([[], []]), "no actions"),
        (lambda: Table.from_rows([["0F0", "zz"]]), "cannot parse action 'zz'"),
        (lambda: Table(2, 1, (0,), [[]]), "stage_to_rank has 1 entries for 2 stages"),
        (lambda: Table(1, 1, (3,), [[]]), "stage 0 is placed on rank 3 but the table has 1 rows"),
        (lambda: Table(0, 1, (), [[]]), "num_stages must be an int >= 1, got 0"),
        (lambda: Table(1, 0, (0,), [[]]), "num_microbatches must be an int >= 1, got 0"),
        (lambda: Table(1, 1, (0,), []), "rows is empty"),
        (lambda: Table(1, 1, (0,), [["0F0"]]),  # type: ignore[list-item]
         "not an Action; use Table.from_rows"),
    ],
)
def test_construction_errors(build_it: object, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        build_it()  # type: ignore[operator]


@settings(max_examples=30, deadline=None)
@given(cases())
def test_json_round_trip(case: tuple[str, int, int, dict[str, int]]) -> None:
    table = schedules.lower(build(*case))
    assert Table.from_json(table.to_json()) == table
    assert Table.from_dict(table.to_dict()) == table


def test_json_errors() -> None:
    with pytest.raises(ScheduleError, match="does not parse"):
        Table.from_json("{")
    with pytest.raises(ScheduleError, match="must be an object"):
        Table.from_json("[]")
    with pytest.raises(ScheduleError, match="not a schedule table"):
        Table.from_json('{"format": "other"}')
    data = schedules.gpipe(1, 1).to_dict()
    del data["rows"]
    with pytest.raises(ScheduleError, match="lacks rows"):
        Table.from_dict(data)


@pytest.mark.parametrize("suffix", [".txt", ".csv", ".json"])
@pytest.mark.parametrize("table", [schedules.zbv(4, 3), schedules.lower(schedules.zb_h1(3, 4)),
                                   schedules.interleaved_1f1b(6, 3, stages_per_rank=2)])
def test_save_load_round_trip(tmp_path: Path, suffix: str, table: Table) -> None:
    path = tmp_path / f"table{suffix}"
    schedules.save_table(table, path)
    assert schedules.load_table(path) == table


def test_load_hand_written_txt(tmp_path: Path) -> None:
    path = tmp_path / "hand.txt"
    path.write_text("# 2 ranks, GPipe\n0F0 0F1   0BW0 0BW1\n\n  1F0 1F1 1BW0 1BW1  \n")
    table = schedules.load_table(path)
    assert table == schedules.gpipe(2, 2)
    schedules.validate(table)


def test_load_csv_in_the_torch_layout(tmp_path: Path) -> None:
    path = tmp_path / "torch.csv"
    path.write_text("0F0,0F1,0B0,0W0,0B1,0W1\n1F0,1B0,1W0,1F1,1B1,1W1,,\n")
    table = schedules.load_table(path)
    assert [str(a) for a in table.rows[1]] == ["1F0", "1B0", "1W0", "1F1", "1B1", "1W1"]
    schedules.validate(table)


def test_txt_keeps_empty_ranks_and_placement(tmp_path: Path) -> None:
    path = tmp_path / "empty.txt"
    path.write_text("# stage_to_rank: 1\n# num_microbatches: 2\n-\n0F0 0BW0 0F1 0BW1\n")
    table = schedules.load_table(path)
    assert (table.num_ranks, table.stage_to_rank, table.rows[0]) == (2, (1,), ())
    path.write_text("# stage_to_rank: one\n0F0\n")
    with pytest.raises(ScheduleError, match="bad directive"):
        schedules.load_table(path)


def test_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match=r"name it \.txt, \.csv or \.json"):
        schedules.load_table(tmp_path / "table.yaml")
