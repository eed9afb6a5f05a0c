"""engine.testing.models(): the drawn cases are well-formed, deterministic, and their losses are batch means."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from ir_cases import ZOO, examples, zoo
from torch.utils import _pytree as pytree

import ir
from engine.testing import LAYER_KINDS, build, max_relative_error, models

ALL_DTYPES = (torch.float64, torch.float32, torch.bfloat16)


@settings(max_examples=examples(60))
@given(models(dtypes=ALL_DTYPES, max_layers=8))
def test_case_shapes_dtypes_and_scalar_loss(case):
    leaves = pytree.tree_leaves(case.params)
    assert leaves and all(t.dtype == case.dtype and t.is_floating_point() for t in leaves)
    b = case.batch[0].shape[0]
    assert b % 8 == 0 and all(t.shape[0] == b for t in case.batch)
    loss = case.fn(case.params, *case.batch)
    assert loss.shape == () and loss.dtype == case.dtype and torch.isfinite(loss)
    assert repr(case) == f"ModelCase({case.description})" and str(case.dtype).split(".")[1] in case.description


@settings(max_examples=examples(60))
@given(models(max_layers=8))
def test_loss_is_a_mean_over_the_batch(case):
    """fnpipe's contract: the full-batch loss is the mean of the microbatch losses (here 2 and 4 of them)."""
    full = case.fn(case.params, *case.batch)
    for k in (2, 4):
        parts = zip(*(t.chunk(k) for t in case.batch))
        mean = sum(case.fn(case.params, *mb) for mb in parts) / k
        assert max_relative_error(mean, full) <= 1e-12


@settings(max_examples=examples(30))
@given(models(dtypes=ALL_DTYPES))
def test_deterministic_given_the_draw(case):
    again = build(case.spec, dtype=case.dtype, seed=case.seed)
    assert again.description == case.description
    for a, b in zip(pytree.tree_leaves((case.params, case.batch)), pytree.tree_leaves((again.params, again.batch))):
        assert torch.equal(a, b)
    assert torch.equal(case.fn(case.params, *case.batch), again.fn(again.params, *again.batch))


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_kinds_restricts_the_layers(kind):
    allowed = {kind, "save", "fork"}  # skip needs a save, aux and merge a fork: the strategy may add them

    @settings(max_examples=examples(10))
    @given(models(kinds=tuple(sorted(allowed)), max_layers=4))
    def check(case):
        assert {layer.kind for layer in case.spec.layers} <= allowed
        case.fn(case.params, *case.batch)

    check()


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="unknown layer kinds.*'conv'"):
        models(kinds=("linear", "conv"))
    with pytest.raises(ValueError, match="floating point"):
        models(dtypes=(torch.int64,))


@settings(max_examples=examples(10))
@given(models(kinds=("skip",)))
def test_kinds_that_cannot_start_give_layerless_models(case):
    assert case.spec.layers == () and "(no layers)" in case.description


def test_zoo_covers_every_kind_and_feature():
    specs = ZOO.values()
    assert {layer.kind for s in specs for layer in s.layers} == set(LAYER_KINDS)
    assert any(s.tied for s in specs) and any(s.embed_op == "index" for s in specs)
    tied = zoo("transformer_lm_tied")
    names = ir.trace(tied.fn, tied.params, *tied.batch).input_names
    assert names[:2] == ("embed", "layers.0.w") and "head.proj" in names and "head.w" not in names
    assert names[-2:] == ("x", "y")
