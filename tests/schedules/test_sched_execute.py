"""execute: the event-driven run gives exactly the reference's times, and the same deadlocks."""

from __future__ import annotations

from _reference_lower import reference_execute
import pytest
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


@settings(max_examples=150, deadline=None)
@given(cases(), st.booleans(), st.data())
def test_execute_with_a_host_equals_the_reference(case: tuple[str, int, int, dict[str, int]], lowered: bool,
                                                  data: st.DataObject) -> None:
    """Each rank's host walking its row (issue times per compute, a post per transfer): the same times as the
    reference, lowered or not, host-bound or not."""
    table = build(*case)
    table = schedules.lower(table) if lowered else table
    n = table.num_stages
    times = st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]) | st.floats(0.0, 5.0), min_size=n, max_size=n)
    costs = Costs(forward=data.draw(times), backward_input=data.draw(times), backward_weight=data.draw(times),
                  comm_latency=data.draw(st.floats(0, 2)), issue_forward=data.draw(times),
                  issue_backward_input=data.draw(times), issue_backward_weight=data.draw(times),
                  issue_transfer=data.draw(times))
    ix = check_structure(table)
    duration = [costs.compute_time(a) if a.is_compute else 0.0 for a in ix.actions]
    transfer = [costs.transfer_time(s) for s in range(n)]
    issue = [costs.issue_time(a) for a in ix.actions]
    posts = [costs.transfer_issue(s) for s in range(n)]
    got = _outcome(lambda *a: execute(*a, issue, posts), ix, duration, transfer)
    want = _outcome(lambda *a: reference_execute(*a, issue, posts), TableIndex(table), duration, transfer)
    if isinstance(got, Timing) and isinstance(want, Timing):
        assert got.start == pytest.approx(want.start, abs=1e-9) and got.end == pytest.approx(want.end, abs=1e-9)
    else:
        assert got == want


def test_a_host_slower_than_its_device_sets_the_step() -> None:
    """Two stages, one microbatch, F = 1, BW = 2 on the device; the host takes 2 to issue each and 0.5 to post a
    transfer. Rank 0 issues F0 until 2 (its device waits) and posts the send until 2.5; rank 1 posts its receive
    (0.5), runs F0 at 2.5-3.5 (the data leaves once the send is posted), issues BW0 (2.5-4.5), runs it at 3.5-5.5
    and posts the grad's send (4.5-5); rank 0 posts its receive (2.5-3), issues BW0 (3-5) and runs it at 5.5-7.5:
    7.5 against 6 with no host."""
    table = schedules.gpipe(2, 1)
    host = Costs(forward=1, backward_input=1, backward_weight=1, issue_forward=2, issue_backward_input=1,
                 issue_backward_weight=1, issue_transfer=0.5)
    sim = schedules.simulate(table, host)
    assert sim.makespan == 7.5
    assert [(str(a), sim.start[a], sim.end[a]) for row in table.rows for a in row] == [
        ("0F0", 0.0, 2.0), ("0BW0", 5.5, 7.5), ("1F0", 2.5, 3.5), ("1BW0", 3.5, 5.5)]
    assert schedules.simulate(table, Costs(forward=1, backward_input=1, backward_weight=1)).makespan == 6.0


@settings(max_examples=60, deadline=None)
@given(cases(), st.booleans(), st.floats(0.0, 1.0))
def test_a_host_that_keeps_ahead_of_its_device_changes_nothing(case: tuple[str, int, int, dict[str, int]],
                                                               lowered: bool, share: float) -> None:
    """Issue times at most the device's (the host runs ahead) and free posts: the same times as without a host."""
    table = build(*case)
    table = schedules.lower(table) if lowered else table
    plain = Costs(forward=1.0, backward_input=2.0, backward_weight=1.5, comm_latency=0.25)
    hosted = Costs(forward=1.0, backward_input=2.0, backward_weight=1.5, comm_latency=0.25, issue_forward=share,
                   issue_backward_input=2 * share, issue_backward_weight=1.5 * share)
    try:
        want = schedules.simulate(table, plain)
    except ScheduleError:
        return
    got = schedules.simulate(table, hosted)
    assert dict(got.start) == dict(want.start) and got.makespan == want.makespan
