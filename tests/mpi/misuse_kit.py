"""What the misuse cases (tests/mpi/misuse.py) share: the issue's MLP, its steps made once, and `silent`."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

import engine
from tests.mpi import models

TIMEOUT = 8.0
CASES: dict[str, Callable[["Ctx"], str]] = {}


def case(fn: Callable[["Ctx"], str]) -> Callable[["Ctx"], str]:
    CASES[fn.__name__] = fn
    return fn


def loss_fn(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The issue's three-layer MLP."""
    h = torch.tanh(x @ params["w1"])
    h = torch.tanh(h @ params["w2"])
    return F.mse_loss(h @ params["w3"], y)


def mlp(params: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.tanh(x @ params["w1"]) @ params["w2"]) @ params["w3"]


def draw(seed: int | None = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Params and a batch of 64; `seed=None` draws from this process's own (unseeded) random state."""
    g = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator().manual_seed(torch.seed())
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {"w1": r(8, 32) / 8**0.5, "w2": r(32, 32) / 32**0.5, "w3": r(32, 1) / 32**0.5}, r(64, 8), r(64, 1)


class Ctx:
    """What the cases share: this rank, the model, and steps made once and reused (lazily)."""

    def __init__(self, world: engine.World) -> None:
        self.world, self.rank = world, world.rank
        self.params, self.x, self.y = draw()
        self._steps: dict[str, engine.Step] = {}

    def step(self, kind: str) -> engine.Step:
        """`base`: the issue's call; `every`/`never`/`first`: cut after w1 with that check_inputs;
        `tied`: the tied-embedding model (its embedding on both ranks); `dp`: one stage, dp 2. Each on 1F1B, whose
        placement (stage k on rank k) the cases read; the cases that call parallelize themselves plan "auto"."""
        if kind not in self._steps:
            p, x, y = self.params, self.x, self.y
            make = {
                "base": lambda: engine.parallelize(loss_fn, p, x, y, schedule="1f1b", microbatches=4, timeout=TIMEOUT),
                "tied": lambda: engine.parallelize(models.loss_fn, models.init_params(layers=4), *models.batch(size=16),
                                                   schedule="1f1b", microbatches=4, timeout=TIMEOUT),
                "dp": lambda: engine.parallelize(loss_fn, p, x, y, microbatches=2, stages=1, dp=2, timeout=TIMEOUT),
            }.get(kind, lambda: engine.parallelize(loss_fn, p, x, y, schedule="1f1b", microbatches=4, cuts=[2],
                                                   check_inputs=kind, timeout=TIMEOUT))
            self._steps[kind] = make()
        return self._steps[kind]

    def local(self, kind: str) -> Any:
        return self.step(kind).shard(self.params)


@contextlib.contextmanager
def silent(step: engine.Step) -> Iterator[None]:
    """Fail if the step communicates inside the block (a local refusal must not)."""
    calls: list[str] = []
    t = step.transport
    saved = {name: getattr(t, name) for name in ("post", "all_reduce", "all_gather", "all_gather_json")}
    for name, fn in saved.items():
        setattr(t, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(t, name, fn)
        if calls:
            raise AssertionError(f"the step communicated ({calls}) before refusing its inputs")


def loss_text(loss: torch.Tensor) -> str:
    return f"loss {float(loss):.6f}"


