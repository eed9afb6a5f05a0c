"""The harness as the suite's own property: pipelined steps equal torch.func.grad for drawn models and plans.

Every built-in schedule plus a registered one, worlds 1/2/4, dp 1/2, drawn cuts and the splitter's, in
one process. The last test checks that the examples really ran (how many, which schedules and layouts).
"""
from __future__ import annotations

import collections
import os
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schedules
from engine.testing import STATS, assert_parallel_equivalent, format_stats, models, models_and_plans, plans
from schedules import ScheduleError, Table, registry

USER_SCHEDULE = "test-lifo-gpipe"
BUILT_IN = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv")
MIN_EXAMPLES = 2000
SCALE = float(os.environ.get("FNPIPE_EXAMPLES", "1"))  # FNPIPE_EXAMPLES=10: ten times the examples
FAST = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

_START: collections.Counter[Any] = collections.Counter()


def examples(n: int) -> int:
    """`n` hypothesis examples, scaled by $FNPIPE_EXAMPLES (as in tests/ir)."""
    return max(1, int(n * SCALE))
_RAN: set[str] = set()


def lifo_gpipe(num_stages: int, num_microbatches: int, **options: object) -> Table:
    """A user's schedule: GPipe's forwards, then the backwards newest microbatch first."""
    if options:
        raise ScheduleError(f"{USER_SCHEDULE} takes no options, got {sorted(options)}")
    m = num_microbatches
    rows = [[f"{s}F{i}" for i in range(m)] + [f"{s}BW{i}" for i in reversed(range(m))] for s in range(num_stages)]
    return Table.from_rows(rows, stage_to_rank=range(num_stages), num_microbatches=m)


@pytest.fixture(scope="module", autouse=True)
def _user_schedule() -> Iterator[None]:
    """Register the user's schedule in a private copy of the registry, so plans() draws it too."""
    _START.update(STATS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
        schedules.register(USER_SCHEDULE, lifo_gpipe)
        yield


# ---------------------------------------------------------------- user-style models (fixed)


def _init(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) / shape[0] ** 0.5


def tied_params(width: int = 4, vocab: int = 7) -> dict[str, Any]:
    return {"embed": _init(0, vocab, width),
            "layers": [{"w": _init(1 + i, width, width), "b": _init(9 + i, width) * 0.1,
                        "ln": 1 + _init(5 + i, width) * 0.1} for i in range(2)],
            "skip": _init(20, width, width)}


def tied_loss(params: dict[str, Any], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Embedding, two layer-normed residual layers, a skip from the first layer, the embedding as head."""
    h = F.embedding(tokens, params["embed"])
    first = None
    for layer in params["layers"]:
        h = h + torch.tanh(F.layer_norm(h, h.shape[-1:], layer["ln"]) @ layer["w"] + layer["b"])
        first = h if first is None else first
    logits = (h + first @ params["skip"]) @ params["embed"].t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tied_batch(size: int = 8, seq: int = 2, vocab: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, (size, seq), generator=g), torch.randint(0, vocab, (size, seq), generator=g)


def mlp_params(width: int = 4) -> dict[str, Any]:
    return {"w1": _init(30, 3, width), "w2": _init(31, width, width), "gate": _init(32, 2, width),
            "out": _init(33, width, 2)}


def mlp_loss(params: dict[str, Any], x: torch.Tensor, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """An MLP whose second batch input `z` joins in the middle; MSE regression."""
    h = F.gelu(x @ params["w1"])
    h = F.layer_norm(h @ params["w2"], h.shape[-1:]) * torch.sigmoid(z @ params["gate"])
    return F.mse_loss(h @ params["out"], y)


def mlp_batch(size: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    return tuple(torch.randn(size, n, generator=g, dtype=torch.float64) for n in (3, 2, 2))


TIED = (tied_loss, tied_params(), *tied_batch())
MLP = (mlp_loss, mlp_params(), *mlp_batch())


def _check(fn: Any, params: Any = None, *batch: Any, test: str, **kw: Any) -> None:
    """One harness check; float64 must agree to 1e-10 relative (the harness's own default, asserted again)."""
    _RAN.add(test)
    result = assert_parallel_equivalent(fn, params, *batch, **kw)
    dtype = fn.dtype if params is None else pytree.tree_leaves(params)[0].dtype
    if dtype == torch.float64:
        assert result.max_rel_error <= 1e-10, result


# ---------------------------------------------------------------- the properties


@settings(FAST, max_examples=examples(900))
@given(plans(batch_size=8, cuts="drawn"))
def test_tied_model_every_plan(spec: Any) -> None:
    _check(*TIED, plan=spec, test="tied")


@settings(FAST, max_examples=examples(650))
@given(st.data())
def test_mlp_explicit_cuts(data: st.DataObject) -> None:
    from engine.testing._cache import graph_of

    fn, params, *batch = MLP
    n = len(graph_of(fn, params, tuple(b[:1] for b in batch)).eqns)
    spec = data.draw(plans(batch_size=8, num_eqns=n, cuts="drawn"), label="plan")
    assert spec.cuts is not None or spec.stages == 1
    _check(fn, params, *batch, plan=spec, test="mlp")


SMALL = dict(max_layers=3, widths=(4, 8), batch_sizes=(8,), max_seq=2)


@settings(FAST, max_examples=examples(200))
@given(models_and_plans(models(dtypes=(torch.float64,), **SMALL), cuts="drawn"))
def test_random_models_float64(case_spec: Any) -> None:
    case, spec = case_spec
    _check(case, plan=spec, test="random64")


@settings(FAST, max_examples=examples(120))
@given(models_and_plans(models(dtypes=(torch.float32,), **SMALL), cuts="drawn"))
def test_random_models_float32(case_spec: Any) -> None:
    case, spec = case_spec
    _check(case, plan=spec, test="random32")


@settings(FAST, max_examples=examples(100))
@given(models_and_plans(models(dtypes=(torch.float64,), **SMALL), schedules=(USER_SCHEDULE,), cuts="drawn"))
def test_user_registered_schedule(case_spec: Any) -> None:
    case, spec = case_spec
    assert spec.schedule == USER_SCHEDULE
    _check(case, plan=spec, test="user")


@settings(FAST, max_examples=examples(60))
@given(plans(batch_size=8, cuts="splitter"))
def test_splitter_chooses_cuts(spec: Any) -> None:
    _check(*TIED, plan=spec, test="splitter")


def test_examples_covered_every_schedule_and_layout() -> None:
    """At least MIN_EXAMPLES checks ran in this module, over every schedule, world 1/2/4 and dp 1/2."""
    wanted = {"tied", "mlp", "random64", "random32", "user", "splitter"}
    assert wanted <= _RAN, f"only part of the module ran ({sorted(_RAN)}); the count needs all of it"
    ran = STATS - _START
    print("\n" + format_stats(ran))
    assert sum(ran.values()) >= min(MIN_EXAMPLES, MIN_EXAMPLES * SCALE)
    assert {k.schedule for k in ran} >= {*BUILT_IN, USER_SCHEDULE}
    assert {k.world_size for k in ran} >= {1, 2, 4}
    assert {k.dp for k in ran} >= {1, 2}
    for name in (*BUILT_IN, USER_SCHEDULE):
        assert sum(n for k, n in ran.items() if k.schedule == name) >= min(50, 50 * SCALE), name
