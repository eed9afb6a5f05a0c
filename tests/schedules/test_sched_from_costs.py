"""Zero-bubble orders from costs: valid, within memory, never slower than the fixed order, deterministic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules
from schedules import Costs, ScheduleError
from schedules._list import list_schedule
from schedules.from_costs import _keys, costs_of

FAMILY = {"zb-h1": (1, {}), "zbv": (2, {}), "interleaved-zb": (2, {"stages_per_rank": 2}), "dualpipev": (2, {})}


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, int, int, Costs]:
    name = draw(st.sampled_from(sorted(FAMILY)))
    v, _ = FAMILY[name]
    p = draw(st.integers(1, 4))
    m = draw(st.integers(2 * p if name == "dualpipev" else 1, 10))
    n = p * v
    times = st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0]), min_size=n, max_size=n)
    costs = Costs(forward=draw(times), backward_input=draw(times), backward_weight=draw(times),
                  comm_latency=draw(st.sampled_from([0.0, 0.25, 1.0])))
    return name, n, m, costs


@settings(max_examples=40, deadline=None)
@given(cases())
def test_orders_from_costs_are_valid_within_memory_and_no_slower(case: tuple[str, int, int, Costs]) -> None:
    name, n, m, costs = case
    options = FAMILY[name][1]
    fixed = schedules.get(name)(n, m, **options)
    built = schedules.get(name)(n, m, costs=costs, **options)
    assert built == schedules.get(name)(n, m, costs=costs, **options)  # deterministic: every rank builds it
    schedules.validate(built)
    schedules.validate(schedules.lower(built, costs=costs))
    mine, theirs = schedules.simulate(built, costs), schedules.simulate(fixed, costs)
    assert mine.makespan <= theirs.makespan + 1e-9
    default = {"zbv": 2 * n // 2, "dualpipev": n + 1}.get(name)
    limit = theirs.peak_live if default is None else (default,) * built.num_ranks
    assert all(a <= b for a, b in zip(mine.peak_live, limit))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_the_screen_times_the_hand_built_orders_and_bounds_the_search(case: tuple[str, int, int, Costs]) -> None:
    """search=False (what the planner ranks layouts with): valid, within memory, no faster than the searched order
    and no slower than the family's fixed order under the same costs."""
    name, n, m, costs = case
    options = FAMILY[name][1]
    screened = schedules.get(name)(n, m, costs=costs, search=False, **options)
    searched = schedules.get(name)(n, m, costs=costs, **options)
    schedules.validate(screened)
    quick, full = schedules.simulate(screened, costs), schedules.simulate(searched, costs)
    fixed = schedules.simulate(schedules.get(name)(n, m, search=False, **options), costs)
    assert full.makespan <= quick.makespan + 1e-9 and quick.makespan <= fixed.makespan + 1e-9
    default = {"zbv": n, "dualpipev": n + 1, "interleaved-zb": n}.get(name)
    if default is not None:
        assert max(quick.peak_live) <= default


def test_max_live_bounds_memory_and_costs_time() -> None:
    costs = Costs.uniform(0.5, 1.0, 0.5)
    roomy = schedules.simulate(schedules.zbv(8, 16, costs=costs), costs)
    tight = schedules.simulate(schedules.zbv(8, 16, costs=costs, max_live=3), costs)
    assert max(tight.peak_live) <= 3 < max(roomy.peak_live)
    assert tight.makespan >= roomy.makespan


def test_list_schedule_makespan_bounds_the_simulation() -> None:
    placement = (0, 1, 1, 0)
    times = ((0.5,) * 4, (1.0,) * 4, (0.5,) * 4, (0.25,) * 4)
    for key in _keys(placement)[:6]:
        done = list_schedule(placement, 6, times, live_limit=(4, 4), key=key, lead=(3, 1))
        assert done is not None
        assert schedules.simulate(done.table(), costs_of(times)).makespan <= done.makespan


def test_list_schedule_events_stay_linear_with_free_actions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stages with zero-time actions (no weights: no W; an empty stage) once made a waiting rank listed again at
    every end, so the events doubled: one zbv order of 8 stages x 4 microbatches took 16 s (the harness's tied
    model). Each action's end wakes every rank at most once, and a waiting rank asks once for an input coming."""
    import schedules._list as module

    pushed = [0]
    push = module.heapq.heappush

    def counting(heap: list, item: object) -> None:
        pushed[0] += 1
        push(heap, item)

    monkeypatch.setattr(module.heapq, "heappush", counting)
    placement, m = (0, 1, 2, 3, 3, 2, 1, 0), 4
    times = ((0.2, 0.4, 0.6, 1.0, 0.4, 0.2, 0.0, 0.4), (0.0, 0.6, 0.2, 1.0, 0.2, 0.2, 0.0, 0.4),
             (0.4, 0.6, 0.4, 1.0, 0.4, 0.4, 0.0, 0.0), (1.0,) * 8)
    for key in _keys(placement)[:2]:
        pushed[0] = 0
        done = list_schedule(placement, m, times, live_limit=(8,) * 4, key=key)
        assert done is not None and schedules.simulate(done.table(), costs_of(times)).makespan <= done.makespan <= 26.2
        assert pushed[0] <= 3 * len(placement) * m * (4 + 2), pushed[0]  # 3 S m actions, 4 ranks


@pytest.mark.parametrize(("options", "message"), [
    ({"costs": (1.0, 2.0)}, r"zbv: costs must be a schedules.Costs or \(forward, backward_input, backward_weight"),
    ({"costs": ((1.0, 2.0), 1.0, 1.0)}, r"zbv: costs' forward must be one number >= 0 or 4 \(one per stage\)"),
    ({"max_live": 1}, r"zbv: max_live must be an int >= 2 \(the stages of a rank\) or one per rank \(2\)"),
    ({"costs": (1, 1, 1), "max_live": (4,)}, r"max_live must be an int >= 2 .* or one per rank \(2\)"),
    ({"costs": (1, 1, 1), "search": "quick"}, r"zbv: search must be True \(search for the order\) or False"),
])
def test_bad_options_name_the_fix(options: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        schedules.zbv(4, 4, **options)
