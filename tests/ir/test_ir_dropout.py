"""ir.keyed_dropout: PyTorch's dropout drawn from per-row keys, so any cut of the batch draws the same masks.

The property everything rests on: the rows a..b of a keyed call on the full batch equal the same call on
rows a..b alone with keys[a:b]. Then a pipeline (which cuts the batch into microbatches, and the model
into stages) computes exactly what one process computes on the full batch with the same keys.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_cases import examples

import ir
from ir.purify import resolve
from engine.testing import assert_parallel_equivalent, plans

SEEDS = st.integers(-(2**62), 2**62)


def drops(x: torch.Tensor, keys: torch.Tensor, p: float) -> list[torch.Tensor]:
    """Each kind of keyed call on `x` ([B, C, L, D]): element, feature (per channel), batch-major view, sdpa."""
    with ir.keyed_dropout(keys):
        b = x.shape[0]
        return [F.dropout(x, p), nn.Dropout2d(p)(x), nn.Dropout(p)(x.reshape(-1, x.shape[-1])).reshape(x.shape),
                F.scaled_dot_product_attention(x, x, x, dropout_p=p, is_causal=True),
                torch.dropout(x.reshape(b, -1), p, True).reshape(x.shape)]


@settings(max_examples=examples(25))
@given(SEEDS, st.sampled_from([0.1, 0.5, 0.9]), st.integers(2, 6), st.data())
def test_any_cut_of_the_batch_draws_the_full_batchs_masks(seed, p, rows, data):
    x = torch.randn(rows, 3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed % 1000))
    keys = ir.row_keys(seed, rows)
    a = data.draw(st.integers(0, rows - 1))
    b = data.draw(st.integers(a + 1, rows))
    for full, part in zip(drops(x, keys, p), drops(x[a:b], keys[a:b], p)):
        assert torch.equal(full[a:b], part)


def test_masks_have_the_rate_and_scale_and_depend_on_seed_and_call():
    x = torch.ones(64, 256, dtype=torch.float64)
    keys = ir.row_keys(3, 64)
    with ir.keyed_dropout(keys):
        first, second = F.dropout(x, 0.25), F.dropout(x, 0.25)
    assert set(first.unique().tolist()) == {0.0, 1 / 0.75}
    assert abs((first == 0).double().mean().item() - 0.25) < 0.01
    assert not torch.equal(first, second)  # the call index is part of the key
    with ir.keyed_dropout(keys):
        assert torch.equal(F.dropout(x, 0.25), first)  # pure: the same keys, the same masks
    with ir.keyed_dropout(ir.row_keys(4, 64)):
        assert not torch.equal(F.dropout(x, 0.25), first)
    assert torch.equal(ir.row_keys(3, 10), keys[:10])  # row r's key does not depend on the batch size


def test_identity_cases_draw_nothing():
    x = torch.randn(4, 6)
    with ir.keyed_dropout(ir.row_keys(0, 4)) as mode:
        assert F.dropout(x, 0.0) is x and F.dropout(x, 0.5, training=False) is x
        assert mode.calls == 0
        assert torch.equal(F.dropout(x, 1.0), torch.zeros_like(x))


def p_zero(p, x, y):
    return F.mse_loss(F.dropout(x @ p["w"], p=0.0, training=True), y)


def test_p_zero_in_train_mode_traces_as_the_identity_without_keys():
    params, x = {"w": torch.randn(4, 4)}, torch.randn(8, 4)
    g = ir.trace(p_zero, params, x, x)
    assert not any("dropout" in e.op for e in g.eqns)
    assert torch.equal(ir.evaluate(g, params, x, x), p_zero(params, x, x))


def keyed_loss(p, x, y, keys):
    """Two layers with dropout and an attention with dropout on the weights, as models write them."""
    with ir.keyed_dropout(keys):
        h = F.dropout(torch.tanh(x @ p["w1"]), p=0.2, training=True)
        q = h.reshape(h.shape[0], 2, 4, 3)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).reshape(h.shape)
        return F.mse_loss(nn.functional.dropout(a, 0.1) @ p["w2"], y)


def keyed_case(batch: int = 16):
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(6, 24, dtype=torch.float64, generator=g) / 3,
              "w2": torch.randn(24, 5, dtype=torch.float64, generator=g) / 5}
    x, y = torch.randn(batch, 6, dtype=torch.float64, generator=g), torch.randn(batch, 5, dtype=torch.float64, generator=g)
    return params, x, y, ir.row_keys(11, batch)


def test_traced_graph_is_plain_integer_ops_and_equals_eager():
    params, x, y, keys = keyed_case()
    g = ir.trace(keyed_loss, params, x, y, keys)
    assert not any(torch.Tag.nondeterministic_seeded in resolve(e.op).tags for e in g.eqns)
    assert torch.equal(ir.evaluate(g, params, x, y, keys), keyed_loss(params, x, y, keys))


@pytest.mark.parametrize("schedule, stages, dp", [("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved-1f1b", 4, 1),
                                                  ("zb-h1", 2, 2), ("zbv", 4, 1), ("1f1b", 2, 2)])
def test_pipeline_with_dropout_equals_one_process_with_the_same_keys(schedule, stages, dp):
    params, x, y, keys = keyed_case()
    result = assert_parallel_equivalent(keyed_loss, params, x, y, keys, schedule=schedule, stages=stages, dp=dp,
                                        rtol=1e-12, atol=1e-14)
    assert result.max_rel_error < 1e-12


@settings(max_examples=examples(8))
@given(plans(batch_size=16))
def test_any_drawn_plan_with_dropout_equals_one_process(spec):
    """Random schedules, stage counts, cut points, microbatch counts and dp: the masks never change."""
    params, x, y, keys = keyed_case()
    assert_parallel_equivalent(keyed_loss, params, x, y, keys, plan=spec, rtol=1e-12, atol=1e-14)


def test_a_sequence_first_tensor_is_refused_naming_the_fix():
    with pytest.raises(ir.TraceError, match=r"shape \[3, 4\], whose dim 0 is not the batch \(4 rows.*batch_first"):
        with ir.keyed_dropout(ir.row_keys(0, 4)):
            F.dropout(torch.ones(3, 4), 0.5)
    with pytest.raises(ir.TraceError, match="int64 keys of ir.row_keys"):
        ir.keyed_dropout(torch.zeros(4))
