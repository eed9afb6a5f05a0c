"""The idle shares and memory the literature gives, reproduced exactly by the simulator."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import assume, given, settings
from hypothesis import strategies as st

import schedules
from schedules import Costs

ranks = st.integers(1, 8)
microbatches = st.integers(1, 32)
SETTINGS = settings(max_examples=60, deadline=None)


def _exact(value: float, expected: Fraction) -> bool:
    return Fraction(value).limit_denominator(10**6) == expected


@SETTINGS
@given(ranks, microbatches)
def test_gpipe_and_1f1b_idle_share(p: int, m: int) -> None:
    expected = Fraction(p - 1, m + p - 1)
    for schedule in (schedules.gpipe, schedules.one_f_one_b):
        sim = schedules.simulate(schedule(p, m))
        assert _exact(sim.bubble_fraction, expected)
        assert sim.makespan == 3 * (m + p - 1)  # F = 1, BW = B + W = 2


@SETTINGS
@given(ranks, microbatches)
def test_peak_live_gpipe_and_1f1b(p: int, m: int) -> None:
    assert schedules.simulate(schedules.gpipe(p, m)).peak_live == (m,) * p
    one_f_one_b = schedules.simulate(schedules.one_f_one_b(p, m))
    assert one_f_one_b.peak_live == tuple(min(m, p - r) for r in range(p))


@SETTINGS
@given(ranks, st.integers(1, 4), st.integers(1, 32))
def test_interleaved_idle_share_and_peak(p: int, v: int, groups: int) -> None:
    m = p * groups
    assume(m <= 64)
    sim = schedules.simulate(schedules.interleaved_1f1b(p * v, m, stages_per_rank=v))
    assert _exact(sim.bubble_fraction, Fraction(p - 1, v * m + p - 1))
    warmup = p if v == 1 else v * p + p - 1  # Megatron's 2(p-1) + (v-1)p warm-up forwards, +1
    assert sim.peak_live[0] == min(v * m, warmup)


@SETTINGS
@given(ranks, microbatches)
def test_zb_h1_idles_a_third_of_1f1b(p: int, m: int) -> None:
    split = Costs.uniform(1, 1, 1)
    zb = schedules.simulate(schedules.zb_h1(p, m), split)
    base = schedules.simulate(schedules.one_f_one_b(p, m), split)
    assert max(zb.peak_live) <= p
    if m >= p:  # the ZB paper's regime: (p-1)(F+B-W) against (p-1)(F+B+W) per rank
        assert zb.idle == (p - 1,) * p
        assert base.idle == (3 * (p - 1),) * p
        assert 3 * sum(zb.idle) == sum(base.idle)
    else:
        assert sum(zb.idle) < sum(base.idle) or p == 1


@SETTINGS
@given(ranks, microbatches)
def test_zbv_idles_no_more_than_zb_h1(p: int, m: int) -> None:
    zbv = schedules.simulate(schedules.zbv(2 * p, m))
    assert max(zbv.peak_live) <= 2 * p  # p in units of a 1F1B stage (two zbv stages)
    if m >= 2 * p:
        zb_h1 = schedules.simulate(schedules.zb_h1(p, m))
        assert sum(zbv.idle) <= sum(zb_h1.idle)
        assert zbv.bubble_fraction <= zb_h1.bubble_fraction
        assert zbv.idle == (p - 1,) * p  # the least possible: rank p-1 waits p-1 to start
        # the same model in twice as many stages costs half per stage: half the idle time
        halved = schedules.simulate(schedules.zbv(2 * p, m), Costs.uniform(0.5, 0.5, 0.5))
        assert halved.idle == ((p - 1) / 2,) * p
