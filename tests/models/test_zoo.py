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



@pytest.mark.parametrize("family", ["llama", "bert"])
def test_programs_measured_before_the_first_step_on_a_transformers_model(family: str) -> None:
    """`Step.profile_programs` on every rank of a 2-stage zb-h1 pipeline of a transformers model (real token
    ids for the embedding; BERT's int64 buffers as leaves): every program the ranks run is measured, the
    prediction from them is a time, and the step that follows computes, bit for bit, what the same pipeline
    computes unprofiled (which test_family_equals_func_grad holds to torch.func.grad)."""
    import torch

    import engine
    from engine.execution.inprocess import build_steps, run_each, run_steps
    from engine.execution.profile import first_instructions

    model = built(family, False)
    plan = engine.plan(model.fn, model.params, *model.batch, world_size=2, schedule="zb-h1", microbatches=2)
    steps = build_steps(model.fn, model.params, model.batch, plan)
    profiles = run_each(steps, lambda step: step.profile_programs(*model.batch))
    assert {p.key for p in profiles[0].programs} == {k for s in steps for k in first_instructions(s.program)}
    assert all(p.seconds > 0 for p in profiles[0].programs)
    assert all(0 < s.predicted_step_time < 60 for s in steps)
    got = run_steps(steps, model.params, model.batch)
    plain = run_steps(build_steps(model.fn, model.params, model.batch, plan), model.params, model.batch)
    assert torch.equal(got.loss, plain.loss)
    pairs = list(zip(pytree.tree_leaves(got.grads, is_leaf=lambda x: x is None),
                     pytree.tree_leaves(plain.grads, is_leaf=lambda x: x is None), strict=True))
    assert sum(g is not None for g, _ in pairs) == sum(x.is_floating_point() for x in pytree.tree_leaves(model.params))
    for g, r in pairs:
        assert (g is None and r is None) or torch.equal(g, r)
