"""lower: where messages go, how they group, and what it refuses."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from _reference_lower import reference_lower
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_cases import build, cases, swap_neighbours

import schedules
from schedules import Action, Costs, ScheduleError, Table
from schedules.execute import execute

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


def _costs(data: st.DataObject, num_stages: int) -> Costs | None:
    """None, or per-stage times: drawn from a few values (so that many actions end at once, the
    ties the ordering must break the same way) or from a range."""
    kind = data.draw(st.sampled_from(["none", "few", "range"]))
    if kind == "none":
        return None
    value = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]) if kind == "few" else st.floats(0.1, 5.0)
    times = st.lists(value, min_size=num_stages, max_size=num_stages)
    return Costs(forward=data.draw(times), backward_input=data.draw(times),
                 backward_weight=data.draw(times))


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_lowering_equals_the_reference_algorithm(case: tuple[str, int, int, dict[str, int]],
                                                 data: st.DataObject) -> None:
    table = build(*case)
    costs = _costs(data, table.num_stages)
    assert schedules.lower(table, costs=costs) == reference_lower(table, costs=costs)


@settings(max_examples=60, deadline=None)
@given(cases(), st.lists(st.tuples(st.integers(0, 7), st.integers(0, 300)), max_size=30),
       st.data())
def test_lowering_irregular_orders_equals_the_reference(
    case: tuple[str, int, int, dict[str, int]], swaps: list[tuple[int, int]], data: st.DataObject
) -> None:
    table = swap_neighbours(build(*case), swaps, schedules.validate)
    costs = _costs(data, table.num_stages)
    lowered = schedules.lower(table, costs=costs)
    assert lowered == reference_lower(table, costs=costs)
    schedules.validate(lowered)


@pytest.mark.parametrize(("name", "stages", "m", "options", "costs"), [
    ("interleaved-1f1b", 32, 16, {"stages_per_rank": 4}, None),  # 3 receivers wait
    ("interleaved-1f1b", 24, 12, {"stages_per_rank": 2}, Costs(forward=1, backward_input=2.5)),
    ("zb-h1", 6, 12, {}, Costs(forward=(1, 3, 2, 1, 2, 1), backward_input=2, backward_weight=1)),
    ("1f1b", 16, 64, {}, None),
])
def test_lowering_runs_the_table_once(monkeypatch: pytest.MonkeyPatch, name: str, stages: int,
                                      m: int, options: dict[str, Any], costs: Costs | None) -> None:
    """One reference run per lower, however many messages there are or receivers wait: when
    one waits, only the computes it delays are timed again (the old algorithm ran the whole
    table again, once per waiting receiver)."""
    runs: list[object] = []

    def counted(*args: Any) -> Any:
        runs.append(args)
        return execute(*args)

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("schedules") and getattr(module, "execute", None) is execute:
            monkeypatch.setattr(module, "execute", counted)
    table = schedules.get(name)(stages, m, **options)
    lowered = schedules.lower(table, costs=costs)
    assert len(runs) == 1
    assert lowered == reference_lower(table, costs=costs)  # the reference runs its own executor


def test_receivers_that_wait_are_timed_again_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The incremental path is what the cases above exercise: count the messages it handles."""
    placer = sys.modules["schedules._placer"].Placer
    settled: list[object] = []
    original = placer._settle

    def counting(self: Any, seeds: Any) -> None:
        settled.append(seeds)
        original(self, seeds)

    monkeypatch.setattr(placer, "_settle", counting)
    table = schedules.interleaved_1f1b(32, 16, stages_per_rank=4)
    assert schedules.lower(table) == reference_lower(table)
    assert len(settled) == 3
