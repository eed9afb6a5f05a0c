"""The harness can fail: each deliberate runtime fault makes `assert_parallel_equivalent` raise."""
from __future__ import annotations

import collections
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings

from engine.testing import ParallelMismatch, assert_parallel_equivalent, faults, plans
from engine.testing._cache import graph_of

FAULTS: dict[str, Callable[[], faults.Fault]] = {
    "swapped microbatches": lambda: faults.SwapMicrobatches(rank=0),
    "dropped W": lambda: faults.DropWeightGrad(rank=0),
    "scaled grad": lambda: faults.ScaleGrad(rank=0, factor=2.0),
    "stale activation": lambda: faults.StaleActivation(rank=1),
}
LAYOUTS = {  # schedule, stages, stages per rank, dp
    "gpipe": ("gpipe", 2, 1, 1), "1f1b": ("1f1b", 2, 1, 1), "zb-h1": ("zb-h1", 2, 1, 1),
    "interleaved": ("interleaved-1f1b", 4, 2, 1), "zbv": ("zbv", 4, 2, 1), "1f1b dp2": ("1f1b", 2, 1, 2),
}


def loss_fn(params: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = x
    for layer in params["layers"]:
        h = h + torch.tanh(F.layer_norm(h, h.shape[-1:]) @ layer["w"] + layer["b"])
    return F.mse_loss(h @ params["head"], y)


def _model() -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / s[0] ** 0.5  # noqa: E731
    params = {"layers": [{"w": r(4, 4), "b": r(4) * 0.1} for _ in range(3)], "head": r(4, 2)}
    return loss_fn, params, r(8, 4) * 2, r(8, 2) * 2


MODEL = _model()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_is_caught(name: str, layout: str) -> None:
    schedule, stages, v, dp = LAYOUTS[layout]
    fault = FAULTS[name]()
    with pytest.raises(ParallelMismatch) as caught:
        assert_parallel_equivalent(*MODEL, schedule=schedule, stages=stages, stages_per_rank=v, dp=dp,
                                   microbatches=4, hook=fault)
    assert fault.fired >= 1
    assert "first differing leaf '" in str(caught.value)


@pytest.mark.parametrize("name", list(FAULTS))
def test_fault_on_an_absent_rank_changes_nothing(name: str) -> None:
    """The control: the hook runs before every instruction, yet a fault that never applies passes."""
    fault = FAULTS[name]()
    fault.rank = 99
    result = assert_parallel_equivalent(*MODEL, schedule="1f1b", stages=2, microbatches=4, hook=fault)
    assert fault.fired == 0 and result.max_rel_error <= 1e-10


def test_scaled_grad_is_reported_by_its_key_path() -> None:
    fault = faults.ScaleGrad(rank=1, factor=1.5, leaf=None)
    fn, params, x, y = MODEL
    with pytest.raises(ParallelMismatch) as caught:
        assert_parallel_equivalent(fn, params, x, y, schedule="gpipe", stages=2, microbatches=2, cuts=(7,), hook=fault)
    graph = graph_of(fn, params, (x[:4], y[:4]))
    names = [graph.input_names[pid] for pid in range(graph.num_params)]
    first = str(caught.value).split("first differing leaf '")[1].split("'")[0]
    assert first in names and first.startswith(("layers.2", "head"))  # rank 1 holds the later stage
    assert str(caught.value).startswith("grads (1 of 7 leaves) differ")


def test_tolerances_are_honoured() -> None:
    """A 1e-6 relative error fails float64's default 1e-10, and passes with rtol=1e-5."""
    kw = dict(schedule="1f1b", stages=2, microbatches=2)
    with pytest.raises(ParallelMismatch):
        assert_parallel_equivalent(*MODEL, hook=faults.ScaleGrad(rank=0, factor=1 + 1e-6), **kw)
    assert_parallel_equivalent(*MODEL, hook=faults.ScaleGrad(rank=0, factor=1 + 1e-6), rtol=1e-5, **kw)


# ---------------------------------------------------------------- every drawn plan catches every fault

CAUGHT: collections.Counter[str] = collections.Counter()


@pytest.mark.parametrize("name", list(FAULTS))
@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans(world_sizes=(2, 4), batch_size=8, cuts="drawn"))
def test_drawn_plans_catch_every_fault(name: str, spec: Any) -> None:
    fault = FAULTS[name]()
    try:
        assert_parallel_equivalent(*MODEL, plan=spec, hook=fault)
    except ParallelMismatch:
        assert fault.fired, f"{fault} never applied, yet the check failed"
        CAUGHT[name] += 1
    else:
        assert not fault.fired, f"{fault} applied and the harness did not notice ({spec})"


def test_drawn_plans_caught_each_fault_often() -> None:
    assert CAUGHT, "test_drawn_plans_catch_every_fault must run first (run the whole module)"
    assert set(CAUGHT) == set(FAULTS) and min(CAUGHT.values()) >= 10, CAUGHT
