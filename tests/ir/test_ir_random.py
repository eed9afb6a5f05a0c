"""ir.random: counter-based randomness from an explicit key, so masks are pure and traceable."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_cases import examples

import ir
from engine.testing import chain_value_and_grad, max_relative_error

KEYS = st.integers(-(2**62), 2**62)


def key(k):
    return torch.tensor(k, dtype=torch.int64)


@settings(max_examples=examples(30))
@given(KEYS, KEYS)
def test_same_key_same_mask_different_keys_differ(k1, k2):
    x = torch.ones(64, 64)
    a, b = ir.random.dropout(x, 0.5, key(k1)), ir.random.dropout(x, 0.5, key(k1))
    assert torch.equal(a, b)
    if k1 != k2:
        assert not torch.equal(a, ir.random.dropout(x, 0.5, key(k2)))


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_keep_rate_and_scaling(p):
    x = torch.full((400, 500), 3.0)
    y = ir.random.dropout(x, p, key(12345))
    kept = y != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.005  # n = 200k: 5 sigma is < 0.0056
    assert torch.allclose(y[kept], torch.tensor(3.0 / (1 - p)))
    rows = kept.double().mean(1)
    assert rows.std().item() < 0.05 or p == 0.0  # positions differ: no row is all kept or all dropped


def test_uniform_range_mean_and_independence_of_neighbours():
    u = ir.random.uniform(key(7), (1000, 100), dtype=torch.float64)
    assert u.min().item() >= 0.0 and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    corr = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()
    assert abs(corr) < 0.01
    assert torch.equal(ir.random.uniform(key(7), (3,)), ir.random.uniform(torch.tensor([7]), (3,)))


def test_bad_probability():
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), got 1.0"):
        ir.random.dropout(torch.ones(3), 1.0, key(0))


def dropout_mlp(p, x, k, y):
    h = ir.random.dropout(torch.tanh(x @ p["w1"]), 0.25, k)
    return F.mse_loss(ir.random.dropout(h @ p["w2"], 0.5, k + 1), y)


def test_traces_into_a_pure_graph_equal_to_eager():
    g = torch.Generator().manual_seed(0)
    p = {"w1": torch.randn(6, 16, generator=g, dtype=torch.float64),
         "w2": torch.randn(16, 3, generator=g, dtype=torch.float64)}
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
    graph = ir.trace(dropout_mlp, p, x, key(0), y)
    assert graph.input_names == ("w1", "w2", "x", "k", "y")
    ir.check(graph)
    losses = set()
    for k in (0, 1, 2**40):
        eager = dropout_mlp(p, x, key(k), y)
        for compiled in (True, False):
            assert torch.equal(ir.evaluate(graph, p, x, key(k), y, compiled=compiled), eager)
        losses.add(eager.item())
    assert len(losses) == 3
    ref = torch.func.grad(dropout_mlp)(p, x, key(5), y)
    _, grads = chain_value_and_grad(graph, p, x, key(5), y, cuts=[len(graph.eqns) // 2])
    assert max_relative_error(grads, ref) <= 1e-12
