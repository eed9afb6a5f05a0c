"""execute: the event-driven run gives exactly the reference's times, and the same deadlocks."""

from __future__ import annotations

from _reference_lower import reference_execute
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_cases import build, cases, swap_neighbours

import schedules
from schedules import Costs, ScheduleError
from schedules.execute import Timing, execute
from schedules.index import TableIndex
from schedules.validate import check_structure


def _outcome(run: object, ix: TableIndex, duration: list[float],
             transfer: list[float]) -> Timing | str:
    try:
        return run(ix, duration, transfer)  # type: ignore[operator, no-any-return]
    except ScheduleError as error:
        return str(error)


@settings(max_examples=150, deadline=None)
@given(cases(), st.booleans(), st.lists(st.tuples(st.integers(0, 7), st.integers(0, 500)),
                                        max_size=12), st.data())
def test_execute_equals_the_reference(case: tuple[str, int, int, dict[str, int]], lowered: bool,
                                      swaps: list[tuple[int, int]], data: st.DataObject) -> None:
    table = build(*case)
    table = swap_neighbours(schedules.lower(table) if lowered else table, swaps, check_structure)
    n = table.num_stages
    times = st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0.0, 5.0),
                     min_size=n, max_size=n)
    costs = Costs(forward=data.draw(times), backward_input=data.draw(times),
                  backward_weight=data.draw(times), comm_latency=data.draw(st.floats(0, 2)),
                  comm_bandwidth=data.draw(st.none() | st.floats(0.5, 4)),
                  activation_bytes=data.draw(times))
    ix = check_structure(table)
    duration = [costs.compute_time(a) if a.is_compute else 0.0 for a in ix.actions]
    transfer = [costs.transfer_time(s) for s in range(n)]
    got = _outcome(execute, ix, duration, transfer)
    want = _outcome(reference_execute, TableIndex(table), duration, transfer)
    if isinstance(got, Timing) and isinstance(want, Timing):
        assert (got.start, got.end) == (want.start, want.end)
    else:
        assert got == want
