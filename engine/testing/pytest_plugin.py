"""pytest plugin for fnpipe's equivalence harness. Enable it in your `conftest.py`:

    pytest_plugins = ["engine.testing.pytest_plugin"]

It gives:

- the `fnpipe_check` fixture: `fnpipe_check(fn, params, *batch, plan=spec)` is
  `engine.testing.assert_parallel_equivalent`, with defaults from the test's marker
  `@pytest.mark.fnpipe(rtol=1e-6, timeout=30)`;
- under mpirun/torchrun, the hypothesis profile "fnpipe-distributed" (derandomized, no example
  database), so every rank draws the same examples in the same order (their programs must match);
- a terminal summary line per schedule: how many equivalence checks ran, by world size, dp and dtype.

    @given(engine.testing.plans(batch_size=16))
    def test_my_model(fnpipe_check, spec):
        fnpipe_check(loss_fn, params, x, y, plan=spec)
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
from hypothesis import settings

from .harness import STATS, Equivalence, assert_parallel_equivalent, format_stats, in_distributed_job

__all__ = ["fnpipe_check"]

DISTRIBUTED_PROFILE = "fnpipe-distributed"
_AT_START: dict[Any, int] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fnpipe(**options): default options of the fnpipe_check fixture "
                                       "(rtol, atol, timeout, distributed)")
    settings.register_profile(DISTRIBUTED_PROFILE, derandomize=True, database=None, deadline=None)
    if in_distributed_job():
        settings.load_profile(DISTRIBUTED_PROFILE)
    _AT_START.update(STATS)


@pytest.fixture
def fnpipe_check(request: pytest.FixtureRequest) -> Callable[..., Equivalence]:
    """`assert_parallel_equivalent` with the options of the test's `@pytest.mark.fnpipe(...)` as defaults."""
    marker = request.node.get_closest_marker("fnpipe")
    defaults = dict(marker.kwargs) if marker else {}

    def check(*args: Any, **kwargs: Any) -> Equivalence:
        return assert_parallel_equivalent(*args, **{**defaults, **kwargs})

    return check


def pytest_terminal_summary(terminalreporter: Any) -> None:
    ran = STATS.copy()
    ran.subtract(_AT_START)
    ran = +ran  # drop zero counts
    if ran:
        terminalreporter.write_sep("-", "fnpipe")
        terminalreporter.write_line(format_stats(ran))
