"""A hand-lowered schedule that deadlocks is reported by the in-process runtime within a second, not hung."""
from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
import torch

import schedules
from engine.execution.inprocess import run_steps
from engine.testing import ParallelDeadlock, PlanSpec, assert_parallel_equivalent
from engine.testing.harness import inprocess_steps
from engine.execution.transport import DeadlockError
from schedules import ScheduleError, Table, registry

# Each rank consumes what it receives before it sends what the other waits for: rank 0 needs stage 1's
# grad for its B before it sends the activation stage 1 needs for its F. (A RECV merely posted before a
# SEND does not deadlock: receives are posted asynchronously, like batch_isend_irecv.)
DEADLOCK_ROWS = [
    "0F0 0RECV_B0 0B0 0W0 0SEND_F0",
    "1RECV_F0 1F0 1B0 1W0 1SEND_B0",
]
CORRECT_ROWS = [
    "0F0 0SEND_F0 0RECV_B0 0B0 0W0",
    "1RECV_F0 1F0 1B0 1W0 1SEND_B0",
]


def _rows(rows: list[str]) -> Any:
    def schedule(num_stages: int, num_microbatches: int, **options: object) -> Table:
        if (num_stages, num_microbatches) != (2, 1) or options:
            raise ScheduleError("this hand-lowered table is for 2 stages and 1 microbatch")
        return Table.from_rows(rows, stage_to_rank=[0, 1], num_microbatches=1)
    return schedule


@pytest.fixture(autouse=True)
def _hand_lowered(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    schedules.register("test-deadlock", _rows(DEADLOCK_ROWS))
    schedules.register("test-hand-lowered", _rows(CORRECT_ROWS))
    yield


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"])
    return ((h @ params["w2"] - y) ** 2).mean()


def _model() -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(3, 4, generator=g, dtype=torch.float64),
              "w2": torch.randn(4, 2, generator=g, dtype=torch.float64)}
    return loss_fn, params, torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g,
                                                                                            dtype=torch.float64)


SPEC = dict(stages=2, microbatches=1, cuts=(1,))


def test_hand_lowered_table_runs_as_written() -> None:
    """The control: the same hand-lowered format with the send first is equivalent (so the check can pass)."""
    result = assert_parallel_equivalent(*_model(), schedule="test-hand-lowered", **SPEC)
    assert result.max_rel_error <= 1e-10


def test_deadlock_reported_within_a_second() -> None:
    fn, params, x, y = _model()
    assert_parallel_equivalent(fn, params, x, y, schedule="test-hand-lowered", **SPEC)  # warm the trace caches
    start = time.perf_counter()
    with pytest.raises(ParallelDeadlock) as caught:
        assert_parallel_equivalent(fn, params, x, y, schedule="test-deadlock", timeout=30.0, **SPEC)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"deadlock took {elapsed:.2f} s to report (the timeout is 30 s)"
    assert isinstance(caught.value.__cause__, DeadlockError)
    message = str(caught.value)
    assert "deadlock: every rank is waiting" in message
    assert "rank 0 waits on recv from r1" in message and "rank 1 waits on recv from r0" in message
    assert "schedules.validate on the lowered table" in message  # the table-level diagnosis, marked cells
    assert "program rank 0" in message and "program rank 1" in message


def test_runtime_raises_deadlock_error_directly() -> None:
    """Below the harness: the Hub raises DeadlockError from run_steps, well before the timeout."""
    fn, params, x, y = _model()
    plan = PlanSpec("test-deadlock", 2, 1, cuts=(1,)).to_plan(fn, params, x, y)
    steps = inprocess_steps(fn, params, (x, y), plan, timeout=30.0)
    start = time.perf_counter()
    with pytest.raises(DeadlockError, match="deadlock"):
        run_steps(steps, params, (x, y))
    assert time.perf_counter() - start < 1.0
