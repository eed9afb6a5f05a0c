"""schedules.Replicas: round-robin routing of a table over unequal replicas, and its simulation."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules
from schedules import (ORDERS, Costs, Replicas, ScheduleError, lower_replicated, replica_rows, simulate,
                       simulate_replicated)

SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2, "zbv": 2}  # stages per rank


def _table(name: str, p: int, m: int) -> schedules.Table:
    v = SCHEDULES[name]
    options = {"stages_per_rank": v} if name == "interleaved-1f1b" else {}
    return schedules.get(name)(p * v, m, **options)


def test_ranks_are_numbered_position_by_position_and_microbatches_go_round_robin() -> None:
    r = Replicas((2, 1, 3))
    assert r.num_ranks == 6 and [r.first(q) for q in range(3)] == [0, 2, 3]
    assert [r.place(k) for k in range(6)] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    assert [r.rank_of(0, mb) for mb in range(4)] == [0, 1, 0, 1]
    assert [r.rank_of(2, mb) for mb in range(4)] == [3, 4, 5, 3]
    assert r.microbatches(4, 6) == (1, 4) and str(r) == "2x1x3"
    with pytest.raises(ScheduleError, match="outside the 6 ranks"):
        r.place(6)


@pytest.mark.parametrize("bad", [(), (0, 1), (2, True), (1.5,)])
def test_counts_must_be_positive_ints(bad: tuple) -> None:
    with pytest.raises(ScheduleError, match="one int >= 1 per pipeline rank"):
        Replicas(bad)


def test_check_names_the_uneven_position_and_the_fix() -> None:
    table = schedules.one_f_one_b(2, 3)
    with pytest.raises(ScheduleError, match=r"3 microbatches do not split evenly over the 2 replicas of pipeline rank "
                                            r"0; .* \(a multiple of 2\)"):
        Replicas((2, 1)).check(table)
    with pytest.raises(ScheduleError, match="3 counts for a table of 2 ranks"):
        Replicas((1, 1, 1)).check(table)


def test_a_rank_runs_its_positions_row_for_the_microbatches_it_owns() -> None:
    table = schedules.one_f_one_b(2, 4)
    rows = Replicas((2, 1)).rows(table)
    assert " ".join(map(str, rows[0])) == "0F0 0BW0 0F2 0BW2"
    assert " ".join(map(str, rows[1])) == "0F1 0BW1 0F3 0BW3"
    assert rows[2] == table.rows[1]


@settings(max_examples=60)
@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(2, 4), per=st.integers(1, 3),
       f=st.floats(0.1, 3), b=st.floats(0.1, 3), latency=st.floats(0, 1))
def test_one_replica_everywhere_is_simulate_on_the_unlowered_table(name: str, p: int, per: int, f: float, b: float,
                                                                   latency: float) -> None:
    table = _table(name, p, per * p)
    costs = Costs(forward=f, backward_input=b, backward_weight=0.5 * b, comm_latency=latency)
    ref = simulate(table, costs)
    run = simulate_replicated(table, Replicas((1,) * p), costs)
    assert run.makespan == pytest.approx(ref.makespan, rel=1e-12)
    assert run.busy == pytest.approx(ref.busy) and run.bubble_fraction == pytest.approx(ref.bubble_fraction)
    assert run.stage_peak_live == ref.stage_peak_live


@settings(max_examples=60)
@given(name=st.sampled_from(sorted(SCHEDULES)), p=st.integers(2, 4), per=st.integers(1, 3),
       f=st.floats(0.1, 3), issue=st.floats(0, 6), post=st.floats(0, 1), latency=st.floats(0, 1))
def test_one_replica_everywhere_is_simulate_with_its_host_too(name: str, p: int, per: int, f: float, issue: float,
                                                               post: float, latency: float) -> None:
    """Each rank's host issuing its computes and posting its transfers: the replicated run with one replica per
    stage is `simulate`'s, host-bound or not."""
    table = _table(name, p, per * p)
    costs = Costs(forward=f, backward_input=2 * f, backward_weight=f, comm_latency=latency, issue_forward=issue,
                  issue_backward_input=issue / 2, issue_backward_weight=issue / 3, issue_transfer=post)
    ref = simulate(table, costs)
    run = simulate_replicated(table, Replicas((1,) * p), costs)
    assert run.makespan == pytest.approx(ref.makespan, rel=1e-12)


@settings(max_examples=60)
@given(name=st.sampled_from(sorted(SCHEDULES)), counts=st.lists(st.integers(1, 3), min_size=2, max_size=4),
       rounds=st.integers(1, 2), order=st.sampled_from(ORDERS))
def test_routed_rows_are_complete_fifo_and_deadlock_free(name: str, counts: list[int], rounds: int,
                                                         order: str) -> None:
    """Every (stage, kind, microbatch) computes once, on the rank that owns the microbatch at its position;
    each receive comes before what needs it and each send after what makes it; each ordered pair of ranks
    receives exactly what it sends, in the same order (the channels are FIFOs); and with sends that never
    wait the rows run to the end (simulate_replicated follows every dependency)."""
    p, r = len(counts), Replicas(tuple(counts))
    m = rounds * 6 * p  # every count in 1..3 divides it
    table = _table(name, p, m)
    try:
        compute = replica_rows(lambda k: _table(name, p, k), m, r, order)
    except ScheduleError:
        assert order == "own"  # a schedule may refuse the smaller microbatch count of a replica's share
        return
    rows = lower_replicated(table, r, compute)
    ran = Counter((a.stage, a.kind, a.microbatch) for row in rows for a in row if a.is_compute)
    assert ran == Counter((a.stage, a.kind, a.microbatch) for row in table.rows for a in row)
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, row in enumerate(rows):
        assert [a for a in row if a.is_compute] == list(compute[rank])
        done = set()
        for a in row:
            assert r.rank_of(table.rank_of(a.stage), a.microbatch) == rank
            done.add((a.stage, a.kind, a.microbatch))
            if a.kind in ("SEND_F", "SEND_B"):
                assert (a.stage, "F", a.microbatch) in done if a.kind == "SEND_F" else \
                    {(a.stage, "B", a.microbatch), (a.stage, "BW", a.microbatch)} & done
            if a.kind in ("F", "B", "BW"):
                need = "RECV_F" if a.kind == "F" else "RECV_B"
                peer = a.stage - 1 if a.kind == "F" else a.stage + 1
                if 0 <= peer < table.num_stages and table.rank_of(peer) != table.rank_of(a.stage):
                    assert (a.stage, need, a.microbatch) in done, (a, row)
            if a.is_comm:
                key = (rank, r.peer(table, a)) if a.is_send else (r.peer(table, a), rank)
                box = sent if a.is_send else received
                box.setdefault(key, []).append((a.boundary, a.kind in ("SEND_F", "RECV_F"), a.microbatch))
    assert sent == received
    assert simulate_replicated(table, r, rows=rows).makespan > 0


def test_replicating_the_costly_stage_balances_the_pipeline() -> None:
    """Stage 0 twice as slow as stage 1: two replicas of it run as fast as two equal stages would."""
    table = schedules.one_f_one_b(2, 8)
    slow = Costs(forward=(2.0, 1.0), backward_input=(4.0, 2.0), backward_weight=0.0)
    even = Costs(forward=1.0, backward_input=2.0, backward_weight=0.0)
    alone = simulate(table, slow).makespan
    replicated = simulate_replicated(table, Replicas((2, 1)), slow)
    assert replicated.makespan < 0.85 * alone
    assert replicated.stage_peak_live[0] == 1 and len(replicated.busy) == 3  # "split" thins 1F1B's warm-up
    assert replicated.busy[0] == replicated.busy[1] == pytest.approx(4 * 6.0)  # four microbatches each
    own = replica_rows(lambda m: schedules.one_f_one_b(2, m), 8, Replicas((2, 1)), "own")
    assert " ".join(map(str, own[1])) == "0F1 0F3 0BW1 0F5 0BW3 0F7 0BW5 0BW7"
    warm = simulate_replicated(table, Replicas((2, 1)), slow, rows=own)
    assert warm.stage_peak_live[0] == 2  # each replica warms up like a whole 1F1B position
    # every rank is busy 24; fill and drain add a slow F (2) and a slow BW (4) on top: 30, where the two
    # even stages take 27 and the slow stage alone 49
    assert warm.makespan == pytest.approx(30.0) and simulate(table, even).makespan == pytest.approx(27.0)


def test_simulate_replicated_reports_rows_that_cannot_finish() -> None:
    bad = schedules.Table.from_rows(["0BW0 0F0", "1F0 1BW0"])
    with pytest.raises(ScheduleError, match="cannot finish"):
        simulate_replicated(bad, Replicas((1, 1)))
