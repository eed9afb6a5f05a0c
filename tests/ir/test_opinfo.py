"""PyTorch's OpInfo database through ir.trace, ir.evaluate and a 2-stage pipeline, against PyTorch.

For every op sampled (every STRIDE-th op of the float64 CPU database and every op on the refusal list;
the whole database with FNPIPE_OPINFO=all), and up to two samples each: where `make_fx` traces it, so
does `ir.trace`; what `ir.trace` traces evaluates to the eager value; where `torch.func.grad`
differentiates it, `engine.testing.assert_parallel_equivalent` at 2 stages cut in the middle matches it.
An op on `REFUSED` (tests/ir/opinfo_ops.py: design refusals, each with its reason) must still fail a
check with fnpipe's message for that reason, and an op on `GAPS` (known differences from eager
torch.func.grad that are not design refusals, each with its cause) must still fail: one that starts
passing fails this test until it is taken off its list. The coverage table is printed at the end of the run.

    FNPIPE_OPINFO=all PYTHONPATH=. python -m pytest -q tests/ir/test_opinfo.py   # all ~676 ops
"""
from __future__ import annotations

import os

import pytest
from opinfo_ops import GAPS, REFUSAL_TEXT, REFUSED, RESULTS, check_op, float64_ops, op_name, sample_ops

STRIDE = 8  # the default run: every 8th op plus the listed ones, ~120 ops: about 30 s of CPU
ALL = os.environ.get("FNPIPE_OPINFO", "") == "all"
OPS = float64_ops() if ALL else sample_ops(float64_ops(), STRIDE)
PAIRS = (("traced", "torch_traced"), ("evaluated", "traced"), ("grads", "torch_grad"))


@pytest.mark.parametrize("op", OPS, ids=op_name)
def test_op_matches_pytorch(op):
    result = check_op(op)
    RESULTS.append(result)
    if result.name in REFUSED or result.name in GAPS:
        _still_refused(result)
        return
    for ours, theirs in PAIRS:
        if result.passed.get(theirs) and not result.passed.get(ours):
            pytest.fail(f"{result.name}: {ours} fails where {theirs} passes: {result.errors.get(ours)}")


def _still_refused(result):
    failed = [c for c, ok in result.passed.items() if ok is False and not c.startswith("torch")]
    listed = "REFUSED" if result.name in REFUSED else "GAPS"
    assert failed, (f"{result.name} is on {listed} ({REFUSED.get(result.name) or GAPS[result.name]}) but passes "
                    f"every check: take it off {listed} in tests/ir/opinfo_ops.py")
    if result.name in REFUSED:
        said = " ".join(result.errors.values())
        texts = REFUSAL_TEXT[REFUSED[result.name]]
        assert any(t in said for t in texts), f"{result.name} fails, but not with its refusal ({texts}): {said}"
