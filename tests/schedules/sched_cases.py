"""Hypothesis strategies and helpers shared by the schedules tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

import schedules
from schedules import Table

ONE_STAGE_PER_RANK = ("gpipe", "1f1b", "zb-h1")


@st.composite
def cases(draw: Any, names: tuple[str, ...] | None = None) -> tuple[str, int, int, dict[str, int]]:
    """(schedule name, num_stages, num_microbatches, options) valid for that schedule, with
    p in 1..8 ranks, m in 1..32 microbatches and 1..4 stages per rank where it applies."""
    name = draw(st.sampled_from(names or schedules.names()))
    p = draw(st.integers(1, 8))
    if name == "interleaved-1f1b":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, 32 // p))
        return name, p * v, m, {"stages_per_rank": v}
    m = draw(st.integers(1, 32))
    return name, 2 * p if name == "zbv" else p, m, {}


def build(name: str, num_stages: int, num_microbatches: int, options: dict[str, int]) -> Table:
    return schedules.get(name)(num_stages, num_microbatches, **options)
