"""The model zoo under every built-in schedule: loss and every grad leaf equal `torch.func.grad` on one process.

Each family (tests/models/zoo.py) at 2 and 4 stages, in process (float64, ~1e-10 relative except where
transformers computes the loss in float32), in eval mode and in train mode with keyed dropout: with the
same `ir.row_keys` the pipeline reproduces the one-process loss and grads whatever the schedule and
stage count. BERT's variables go in whole: its int64 `token_type_ids` / `position_ids` buffers are leaves
of the checked tree (None grads), as `engine.functionalize` makes them.
"""
from __future__ import annotations

import functools

import pytest
from torch.utils import _pytree as pytree

from engine.testing import ModelCase, assert_parallel_equivalent
from tests.models.zoo import FAMILIES, FLOAT32_LOSS

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")


@functools.cache
def built(family: str, dropout: bool) -> ModelCase:
    return FAMILIES[family](dropout=dropout)


def _params(dropout_families: tuple[str, ...]) -> list:
    return [pytest.param(family, dropout, schedule, stages,
                         id=f"{family}{'-dropout' if dropout else ''}-{schedule}-{stages}")
            for family in FAMILIES for dropout in ((False, True) if family in dropout_families else (False,))
            for schedule in SCHEDULES for stages in (2, 4)]


@pytest.mark.parametrize("family, dropout, schedule, stages", _params(("gpt2", "llama", "bert", "t5", "vit")))
def test_family_equals_func_grad(family: str, dropout: bool, schedule: str, stages: int) -> None:
    model = built(family, dropout)
    rtol = 1e-6 if family in FLOAT32_LOSS else 1e-10
    result = assert_parallel_equivalent(model, schedule=schedule, stages=stages, rtol=rtol, atol=1e-12)
    floating = [x for x in pytree.tree_leaves(model.params) if x.is_floating_point()]  # integer leaves: None grads
    assert result.max_rel_error <= rtol and result.leaves == len(floating)

