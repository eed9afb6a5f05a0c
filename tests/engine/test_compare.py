"""`engine.testing.max_relative_error`: each leaf's error against its own norm, a floor of the tree's scale for
small leaves, and the scale itself for a leaf at its dtype's round-off of it (an exact zero computed two ways)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.testing import max_relative_error
from engine.testing.models import Layer, ModelSpec, build

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ir"))
from ir_cases import trace_case  # noqa: E402


def test_a_zero_leaf_computed_two_ways_is_round_off_of_the_trees_scale() -> None:
    """torch.func.grad gave a zero grad as 1.9e-16, fnpipe 2.1e-16 away from it, beside leaves of norm 1: 2e-16
    against the scale, where the floor alone (1e-6 of it) read 2e-10."""
    expected = [torch.ones(4, dtype=torch.float64) / 2, torch.full((2,), 1.9e-16 / 2 ** 0.5, dtype=torch.float64)]
    actual = [expected[0].clone(), expected[1] + 2.1e-16 / 2 ** 0.5]
    assert max_relative_error(actual, expected) == pytest.approx(2.1e-16, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_small_real_leaves_are_still_measured_against_their_own_or_the_floor(dtype: torch.dtype) -> None:
    big = torch.ones(4, dtype=dtype)
    small = torch.full((4,), 1e-3, dtype=dtype)  # well above round-off: its own norm
    assert max_relative_error([big, small * 1.01], [big, small]) == pytest.approx(0.01, rel=1e-3)
    tiny = torch.full((4,), 1e-9, dtype=torch.float64)  # float64, below the floor, above round-off: the floor
    wrong = max_relative_error([big.double(), tiny * 2], [big.double(), tiny])
    assert wrong == pytest.approx(2e-9 / 2e-6, rel=1e-6)  # ‖tiny‖ = 2e-9 against 1e-6 x ‖big‖ = 2e-6
    assert max_relative_error([big, torch.full((4,), 1e-3, dtype=dtype)], [big, torch.zeros(4, dtype=dtype)]) \
        == pytest.approx(2e-3 / 2, rel=1e-3)  # a leaf that should be zero and is not: against the scale


def test_the_float64_property_example_that_read_2e_10_passes_at_1e_10() -> None:
    """NOTES.md (session 18): with S = 1 the softmax runs over one key, so w_q's and w_k's grads are exactly zero
    and both sides return round-off; every other leaf agrees to 8e-16."""
    layers = (Layer("inject"), Layer("attention", heads=1), Layer("linear", 4, "silu"),
              Layer("residual", 12, "identity"), Layer("save", slot=0), Layer("residual", 4, "relu"),
              Layer("linear", 4, "gelu"))
    spec = ModelSpec(layers, tokens=False, d_in=4, vocab=0, embed_op="embedding", head="mse", tied=False, outputs=2,
                     batch_size=8, seq=1, z_width=4)
    case = build(spec, seed=22)
    assert str(case.description).startswith("float64 B=8 S=1 seed=22: x(4) | inject(z) | attention(heads=1)")
    from engine.testing import chain_value_and_grad

    ref_grads, ref_loss = torch.func.grad_and_value(case.fn)(case.params, *case.batch)
    loss, grads = chain_value_and_grad(trace_case(case), case.params, *case.batch, cuts=[], compiled=True)
    assert max_relative_error(loss, ref_loss) <= 1e-10 and max_relative_error(grads, ref_grads) <= 1e-10
