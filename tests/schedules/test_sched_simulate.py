"""simulate: exact times under costs, communication, memory, speed and immutability."""

from __future__ import annotations

import time

import pytest

import schedules
from schedules import Action, Costs, ScheduleError, Table


def test_per_stage_costs_by_hand() -> None:
    costs = Costs(forward=(1, 2), backward_input=1, backward_weight=1)
    sim = schedules.simulate(schedules.gpipe(2, 2), costs)
    assert sim.start[Action(1, "F", 1)] == 3 and sim.end[Action(1, "BW", 1)] == 9
    assert sim.start[Action(0, "BW", 0)] == 7
    assert (sim.makespan, sim.busy, sim.idle) == (11, (6, 8), (5, 3))
    assert sim.bubble_fraction == pytest.approx(8 / 22)


def test_transfer_time_on_unlowered_tables() -> None:
    costs = Costs(comm_latency=0.25, comm_bandwidth=200, activation_bytes=(100, 0))
    assert costs.transfer_time(0) == 0.75
    sim = schedules.simulate(schedules.one_f_one_b(2, 1), costs)
    assert sim.start[Action(1, "F", 0)] == 1.75  # 0F0 ends at 1, plus 0.75 to cross
    assert sim.start[Action(0, "BW", 0)] == 5.5  # 1BW0 ends at 4.75, plus 0.75 back
    assert sim.makespan == 7.5


def test_rendezvous_on_lowered_tables() -> None:
    lowered = schedules.lower(schedules.gpipe(2, 1))
    assert str(lowered) == (
        "   0        1        2        3\n"
        "r0 0F0      0SEND_F0 0RECV_B0 0BW0\n"
        "r1 1RECV_F0 1F0      1BW0     1SEND_B0"
    )
    sim = schedules.simulate(lowered, Costs(comm_latency=0.5))
    send, recv_b = Action(0, "SEND_F", 0), Action(0, "RECV_B", 0)
    assert (sim.start[send], sim.end[send]) == (1, 1.5)  # the sender waits for the transfer
    # lowering grouped the send with the receive after it: both posted at 1, the receive done
    # when rank 1's grad (ready at 4.5) has crossed
    assert (sim.start[recv_b], sim.end[recv_b]) == (1, 5)
    assert (sim.start[Action(0, "BW", 0)], sim.makespan) == (5, 7)
    assert sim.busy == (3, 3)


def test_bw_costs_b_plus_w_and_uniform() -> None:
    costs = Costs.uniform(1, 2, 3)
    assert costs.compute_time(Action(0, "BW", 0)) == 5
    assert costs.compute_time(Action(0, "W", 0)) == 3
    sim = schedules.simulate(schedules.one_f_one_b(1, 2), costs)
    assert sim.makespan == 12 and sim.bubble_fraction == 0


def test_memory_and_peak_live() -> None:
    costs = Costs(memory_per_microbatch=(10, 20), static_memory=(5, 7))
    sim = schedules.simulate(schedules.one_f_one_b(2, 4), costs)
    assert sim.peak_live == (2, 1)
    assert sim.peak_memory == (25, 27)
    split = Costs(memory_per_microbatch=4, memory_b_to_w=1)
    one_rank = Table.from_rows([["0F0", "0F1", "0B0", "0B1", "0W0", "0W1"]])
    assert schedules.simulate(one_rank, split).peak_memory == (10,)  # 2 * (4 + 1)
    assert schedules.simulate(one_rank, split).peak_live == (2,)


def test_single_rank_has_no_bubble() -> None:
    sim = schedules.simulate(schedules.zb_h1(1, 5))
    assert (sim.bubble_fraction, sim.idle, sim.makespan) == (0.0, (0.0,), 15)


def test_simulation_is_frozen() -> None:
    sim = schedules.simulate(schedules.gpipe(2, 2))
    with pytest.raises(AttributeError):
        sim.makespan = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        sim.start[Action(0, "F", 0)] = 3  # type: ignore[index]
    assert str(sim) == "makespan 9, bubble 33.3%, peak live (2, 2)"


def test_invalid_tables_fail_validation_first() -> None:
    with pytest.raises(ScheduleError, match="has no matching 0W0"):
        schedules.simulate(Table.from_rows([["0F0", "0B0"]]))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Costs(forward=-1), r"Costs.forward must be finite and >= 0, got -1.0"),
    (lambda: Costs(backward_weight=(1, float("nan"))), r"backward_weight must be finite"),
    (lambda: Costs(forward="fast"), r"costs take a number or a sequence of numbers, got 'fast'"),  # type: ignore[arg-type]
    (lambda: Costs(comm_latency=(1, 2)), r"comm_latency must be one number"),  # type: ignore[arg-type]
    (lambda: Costs(comm_bandwidth=0), r"comm_bandwidth must be > 0 bytes per time unit"),
])
def test_cost_errors(make: object, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        make()  # type: ignore[operator]


def test_cost_lengths_must_match_the_table() -> None:
    with pytest.raises(ScheduleError, match=r"Costs\.forward has 2 values but the table has 3 "
                                            r"stages; give one number for all or one per stage"):
        schedules.simulate(schedules.gpipe(3, 1), Costs(forward=(1, 2)))
    with pytest.raises(ScheduleError, match="static_memory has 1 values but the table has 2 ranks"):
        schedules.simulate(schedules.zbv(4, 1), Costs(static_memory=(1,)))


def test_64_ranks_256_microbatches_is_exact_and_not_quadratic() -> None:
    """The speed figure (0.17 s on a quiet 2-core machine) is measured by benchmarks/simulate_speed.py;
    on a shared CI machine this only guards against an algorithm that grows with steps x actions."""
    table = schedules.one_f_one_b(64, 256)
    began = time.perf_counter()
    sim = schedules.simulate(table)
    elapsed = time.perf_counter() - began
    assert sim.makespan == 3 * (256 + 63)
    assert elapsed < 10.0, f"simulate took {elapsed:.2f} s"


@pytest.mark.parametrize(("p", "m"), [(4, 8), (3, 2)])
def test_each_stage_peaks_on_its_own(p: int, m: int) -> None:
    """Per stage: 1F1B stage s holds min(m, p - s) microbatches; interleaved stages of one rank each less
    than the rank; bytes per stage are its live microbatches times its per-microbatch bytes."""
    costs = schedules.Costs(memory_per_microbatch=tuple(10.0 + s for s in range(p)))
    sim = schedules.simulate(schedules.one_f_one_b(p, m), costs)
    assert sim.stage_peak_live == tuple(min(m, p - s) for s in range(p))
    assert sim.stage_peak_memory == tuple(min(m, p - s) * (10.0 + s) for s in range(p))
    inter = schedules.simulate(schedules.interleaved_1f1b(2 * p, 2 * p, stages_per_rank=2))
    for rank in range(p):
        mine = inter.table.stages_of(rank)
        assert all(0 < inter.stage_peak_live[s] <= inter.peak_live[rank] for s in mine)
        assert sum(inter.stage_peak_live[s] for s in mine) >= inter.peak_live[rank]
