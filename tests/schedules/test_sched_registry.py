"""The registry: built-in names, lookup errors with the closest name, registering more."""

from __future__ import annotations

import pytest

import schedules
from schedules import ScheduleError, Table, registry


@pytest.fixture(autouse=True)
def _private_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def test_built_in_names() -> None:
    assert schedules.names() == ("1f1b", "dualpipev", "gpipe", "interleaved-1f1b", "interleaved-zb",
                                 "looped-bfs", "zb-h1", "zbv")
    assert schedules.get("looped-bfs") is schedules.looped_bfs
    assert schedules.get("interleaved-zb") is schedules.interleaved_zb
    assert schedules.get("dualpipev") is schedules.dualpipev
    assert schedules.get("1f1b") is schedules.one_f_one_b
    assert schedules.get("interleaved-1f1b") is schedules.interleaved_1f1b


@pytest.mark.parametrize(("name", "closest"), [
    ("1fb1", "1f1b"), ("GPipe", "gpipe"), ("zb_h1", "zb-h1"), ("interleaved", "interleaved-zb"), ("interleaved1f1b", "interleaved-1f1b"),
    ("zb-v", "zbv"),
])
def test_unknown_name_lists_known_and_closest(name: str, closest: str) -> None:
    with pytest.raises(ScheduleError) as caught:
        schedules.get(name)
    assert str(caught.value) == (
        f"unknown schedule {name!r}; known: 1f1b, dualpipev, gpipe, interleaved-1f1b, interleaved-zb, "
        f"looped-bfs, zb-h1, zbv; "
        f"did you mean {closest!r}?"
    )


def _one_rank(num_stages: int, num_microbatches: int, **options: object) -> Table:
    rows = [[f"{s}F{i}" for s in range(num_stages) for i in range(num_microbatches)]
            + [f"{s}BW{i}" for s in reversed(range(num_stages)) for i in range(num_microbatches)]]
    return Table.from_rows(rows, stage_to_rank=[0] * num_stages)


def test_register_and_overwrite() -> None:
    schedules.register("one-rank", _one_rank)
    assert "one-rank" in schedules.names()
    table = schedules.get("one-rank")(3, 2)
    schedules.validate(table)
    assert schedules.simulate(table).bubble_fraction == 0
    with pytest.raises(ScheduleError, match="'one-rank' is already registered; pass "
                                            "overwrite=True"):
        schedules.register("one-rank", schedules.gpipe)
    schedules.register("one-rank", schedules.gpipe, overwrite=True)
    assert schedules.get("one-rank") is schedules.gpipe


@pytest.mark.parametrize(("name", "fn", "message"), [
    ("", schedules.gpipe, "non-empty str"),
    (3, schedules.gpipe, "non-empty str"),
    ("x", "gpipe", "must be callable"),
])
def test_register_errors(name: object, fn: object, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        schedules.register(name, fn)  # type: ignore[arg-type]
