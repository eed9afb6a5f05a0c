"""engine.setup_clock: parallelize's time to the first step, phase by phase."""
from __future__ import annotations

import time

import pytest
import torch

import engine
from engine.setup_clock import SetupClock


def test_phases_add_up_under_their_names_in_first_run_order():
    clock = SetupClock()
    with clock.phase("plan"):
        time.sleep(0.02)
    with clock.phase("compile"):
        time.sleep(0.01)
    with clock.phase("plan"):
        time.sleep(0.02)
    clock.add("trace", 0.015)
    clock.take("plan", 0.015)
    laps = clock.seconds()
    assert list(laps) == ["plan", "compile", "trace"]
    assert laps["plan"] == pytest.approx(0.025, abs=0.015)
    assert laps["trace"] == 0.015
    assert sum(laps.values()) <= clock.total
    assert str(clock).startswith("setup ") and "plan 0.0 s" in str(clock)
    clock.take("absent", 1.0)  # nothing to take from: no phase appears
    assert "absent" not in clock.seconds()


def _loss(p, x):
    return ((x @ p["w"]).tanh() @ p["v"]).pow(2).mean()


def test_parallelize_times_each_phase_and_a_resplit_adds_to_them():
    params = {"w": torch.randn(16, 16, dtype=torch.float64), "v": torch.randn(16, 4, dtype=torch.float64)}
    x = torch.randn(8, 16, dtype=torch.float64)
    began = time.perf_counter()
    step = engine.parallelize(_loss, params, x, microbatches=2, compiler="fx", rebalance=True)
    spent = time.perf_counter() - began
    laps = step.setup.seconds()
    for name in ("launch", "plan", "trace", "differentiate", "connect", "programs", "verify", "compile", "measure"):
        assert name in laps, (name, laps)
    assert laps["trace"] > 0 and all(v >= 0 for v in laps.values())
    assert sum(laps.values()) <= spent
    loss, grads = step(step.shard(params), x)
    want = torch.func.grad_and_value(_loss)(params, x)
    torch.testing.assert_close(loss, want[1], rtol=1e-12, atol=0)
    for name in params:
        torch.testing.assert_close(grads[name], want[0][name], rtol=1e-10, atol=1e-12)
    step.close()
