"""Byte counts print in the unit that fits: SplitError and plan tables stay readable for small and large models."""
from __future__ import annotations

import pytest
import torch

import engine
from engine.units import nbytes


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (10 * 2**20 + 2**19, "10.5 MiB"),
    (2**30 - 1, "1.0 GiB"), (int(5.72 * 2**30), "5.7 GiB"), (80 * 10**9, "74.5 GiB"), (3 * 2**40, "3.0 TiB"),
    (-2048, "-2.0 KiB"),
])
def test_bytes_take_the_unit_that_fits(n: int, text: str) -> None:
    assert nbytes(n) == text


def _mlp(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ params["w1"])
    return torch.nn.functional.mse_loss(torch.tanh(h @ params["w2"]) @ params["w3"], y)


def test_a_tiny_memory_limit_names_bytes_not_zero_gib() -> None:
    """The issue's case: memory_limit=1024 on a small model printed `needs at least 0.0 GiB ... 0.0 GiB`."""
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 32, generator=g), "w2": torch.randn(32, 32, generator=g),
              "w3": torch.randn(32, 1, generator=g)}
    with pytest.raises(engine.SplitError) as caught:
        engine.plan(_mlp, params, torch.randn(64, 8), torch.randn(64, 1), world_size=2, microbatches=4,
                    memory_limit=1024)
    msg = str(caught.value)
    assert "0.0 GiB" not in msg and "limit is 1.0 KiB" in msg, msg
    assert " KiB with " in msg and "needs at least" in msg, msg
