"""engine.testing.mismatch: empty leaves and non-finite values compare as `equal_nan` says (properties)."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.testing.mismatch import compare_leaves

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
values = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def leaves(draw: st.DrawFn, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    shape = draw(shapes) if shape is None else shape
    n = math.prod(shape)
    return torch.tensor(draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float64).reshape(shape)


@st.composite
def special(draw: st.DrawFn) -> torch.Tensor:
    """A leaf of at least one element, with NaN and infinities at some positions."""
    x = draw(leaves(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple))))
    flat = x.reshape(-1)
    for i in draw(st.lists(st.integers(0, flat.numel() - 1), max_size=flat.numel(), unique=True)):
        flat[i] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return x


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_leaves_with_no_elements_pass_and_take_no_part_in_the_scale(data):
    empty = torch.empty(data.draw(shapes.filter(lambda s: math.prod(s) == 0) | st.just((0,))), dtype=torch.float64)
    other = data.draw(leaves())
    diffs = compare_leaves(["empty", "other"], [empty.clone(), other.clone()], [empty, other], rtol=None, atol=None)
    assert diffs[0].ok and diffs[0].max_abs == 0.0 and diffs[0].index == ()
    assert diffs[1].ok
    wrong = compare_leaves(["empty"], [torch.empty(3, dtype=torch.float64)], [empty], rtol=None, atol=None)[0]
    assert not wrong.ok  # a shape mismatch is still one


@settings(max_examples=100, deadline=None)
@given(special(), st.data())
def test_nan_equals_nan_and_inf_the_same_inf(expected, data):
    finite = torch.isfinite(expected)
    noise = torch.where(finite, expected * 1e-13, torch.zeros_like(expected))
    same = compare_leaves(["w"], [expected + noise], [expected], rtol=None, atol=None)[0]
    assert same.ok, same.describe()
    assert torch.allclose(expected + noise, expected, rtol=1e-10, equal_nan=True)  # the semantics stated
    # change one position's kind (number <-> NaN <-> inf): a mismatch, reported at that position
    k = data.draw(st.integers(0, expected.numel() - 1))
    actual = expected.clone().reshape(-1)
    was = actual[k].item()
    kinds = (math.nan, math.inf, -math.inf) + ((1.5,) if not math.isfinite(was) else ())
    actual[k] = data.draw(st.sampled_from([x for x in kinds if not _same(x, was)]))
    diff = compare_leaves(["w"], [actual.reshape(expected.shape)], [expected], rtol=None, atol=None)[0]
    assert not diff.ok and diff.max_abs == math.inf
    assert diff.index == tuple(int(i) for i in torch.unravel_index(torch.tensor(k), expected.shape))
    assert not torch.allclose(actual.reshape(expected.shape), expected, rtol=1e-10, equal_nan=True)


def _same(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


@settings(max_examples=60, deadline=None)
@given(special())
def test_a_non_finite_leaf_does_not_blow_up_the_others_tolerance(bad):
    good = torch.tensor([1.0, 2.0], dtype=torch.float64)
    off = good + torch.tensor([0.0, 1e-3], dtype=torch.float64)  # far beyond 1e-10 of a scale of 2
    diffs = compare_leaves(["bad", "good"], [bad.clone(), off], [bad, good], rtol=None, atol=None)
    assert diffs[0].ok and not diffs[1].ok


def test_an_efficient_zero_tensor_grad_compares_like_zeros():
    """autograd returns some all-zero grads (sgn of a real input) as storage-less zero tensors"""
    zero = torch._efficientzerotensor((3, 2), dtype=torch.float64)
    assert compare_leaves(["w"], [torch.zeros(3, 2, dtype=torch.float64)], [zero], rtol=None, atol=None)[0].ok
    diff = compare_leaves(["w"], [torch.ones(3, 2, dtype=torch.float64)], [zero], rtol=None, atol=None)[0]
    assert not diff.ok and diff.max_abs == 1.0
