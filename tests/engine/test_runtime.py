"""The executor and transports: a step leaves nothing behind, hooks see the program, failures name the peer."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import ir

from engine import CommTimeoutError
from engine.inprocess import build_steps, run_steps
from engine.plan import Plan, StagePlan
from engine.transport import DistTransport
from tests.mpi import models

PARAMS = models.init_params(layers=4)
BATCH = models.batch(size=8)


def two_ranks(schedule: str = "1f1b", **kw) -> tuple:
    stages = 4 if schedule in ("zbv", "interleaved-1f1b") else 2
    options = (("stages_per_rank", 2),) if schedule == "interleaved-1f1b" else ()
    plan = Plan(schedule, stages, 2, 1, 4, tuple(7 * k for k in range(1, stages)),
                stages=tuple(StagePlan(k, 0, 0, 0) for k in range(stages)), schedule_options=options)
    return build_steps(models.loss_fn, PARAMS, BATCH, plan, **kw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zbv", "interleaved-1f1b"])
def test_a_step_leaves_nothing_behind_and_repeats_exactly(schedule: str) -> None:
    steps = two_ranks(schedule)
    first = run_steps(steps, PARAMS, BATCH)
    second = run_steps(steps, PARAMS, BATCH)  # same executors: no state may leak from one step to the next
    ref = torch.func.grad(models.loss_fn)(PARAMS, *BATCH)
    for step in steps:
        ex = step.executor
        assert ex.bufs == {} and ex.pending == {} and ex.sends == [], schedule
    assert torch.equal(first.loss, second.loss)
    for name in ("embed", "skip"):
        assert torch.equal(first.grads[name], second.grads[name])
        torch.testing.assert_close(first.grads[name], ref[name], rtol=1e-10, atol=0)


def test_the_hook_sees_every_instruction_in_order_and_can_skip_one() -> None:
    seen: dict[int, list] = {0: [], 1: []}
    skipped = []

    def hook(executor, ins):
        seen[executor.program.rank].append(ins)
        if ins.kind == "add_loss" and ins.mb == 3:  # drop the last microbatch's share of the loss
            skipped.append(ins)
            return "skip"
        return None

    steps = two_ranks("1f1b", hook=hook)
    result = run_steps(steps, PARAMS, BATCH)
    for rank, step in enumerate(steps):
        assert seen[rank] == list(step.program.instrs)
    assert len(skipped) == 1
    last = models.loss_fn(PARAMS, *(t[6:] for t in BATCH))  # microbatch 3: rows 6-7 of 8
    full = models.loss_fn(PARAMS, *BATCH)
    torch.testing.assert_close(result.loss, full - last / 4, rtol=1e-12, atol=0)


def test_an_error_on_one_rank_reaches_the_others_at_once() -> None:
    """In-process, a rank that raises marks the run failed: its peers stop waiting, long before the timeout."""
    def hook(executor, ins):
        if executor.program.rank == 1 and ins.kind == "backward_input":
            raise RuntimeError("boom on rank 1")

    steps = two_ranks("1f1b", hook=hook)
    errors: list = [None, None]

    def work(r: int) -> None:
        try:
            steps[r](steps[r].shard(PARAMS), *BATCH)
            steps[r].transport.hub.exit(r)
        except BaseException as exc:  # noqa: BLE001 -- inspected below
            errors[r] = exc
            steps[r].transport.hub.exit(r, f"{type(exc).__name__}: {exc}")

    start = time.monotonic()
    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - start < 5.0  # the hub's timeout is 30 s
    assert isinstance(errors[1], RuntimeError) and "boom" in str(errors[1])
    assert isinstance(errors[0], CommTimeoutError), errors
    assert "rank 1 failed: RuntimeError: boom on rank 1" in str(errors[0])


def test_a_distributed_failure_names_the_rank_and_what_was_awaited() -> None:
    """The message a survivor prints (tests/engine/test_failures.py sees it end to end)."""
    t = DistTransport.__new__(DistTransport)  # only the message: no process group needed
    t.rank, t.timeout = 2, 10.0
    one = t._failure("receiving b4 (recv from rank 1)", RuntimeError("Connection closed by peer\nmore"), (1,))
    assert str(one) == ("rank 2: receiving b4 (recv from rank 1) failed (timeout 10 s): rank 1 died or hangs; "
                        "check its log. Connection closed by peer")
    many = t._failure("summing (all-reduce over ranks [0, 1, 2, 3])", RuntimeError("Timed out"), (0, 1, 3))
    assert "one of ranks [0, 1, 3] died or hangs" in str(many)


def test_a_non_contiguous_grad_handed_over_on_the_same_rank_is_made_contiguous():
    """zbv keeps stages 1 and 2 on rank 1: stage 2's input grad is a transpose (not contiguous) and stage
    1's backward views it. Stage programs are traced with contiguous inputs, so the runtime must hand
    them contiguous values (found by the harness in CI's derandomized run)."""
    from engine.testing import assert_parallel_equivalent

    def fn(p, x):
        h = (x @ p["w"]).view(x.shape[0], 2, 2)   # stage 1: the view
        t = h.transpose(1, 2)                     # stage 2: grad w.r.t. h is a transpose
        return (t * p["v"]).sum(dim=(1, 2)).mean()

    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 4, generator=g, dtype=torch.float64),
              "v": torch.randn(2, 2, generator=g, dtype=torch.float64)}
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    graph = ir.trace(fn, params, x[:1])
    ops = [e.op for e in graph.eqns]
    cuts = [ops.index("aten.view.default"), ops.index("aten.transpose.int"), ops.index("aten.transpose.int") + 1]
    assert_parallel_equivalent(fn, params, x, schedule="zbv", stages=4, microbatches=2, cuts=cuts)
