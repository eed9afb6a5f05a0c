"""The executor and transports: a step leaves nothing behind, hooks see the program, failures name the peer."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import ir

from engine import CommTimeoutError
from engine.execution.inprocess import build_steps, run_steps
from engine.execution.program import COMPUTE
from engine.planning.plan import Plan, StagePlan
from engine.execution.transport import DistTransport
from tests.mpi import models

PARAMS = models.init_params(layers=4)
BATCH = models.batch(size=8)
ALL = ["gpipe", "1f1b", "zb-h1", "zbv", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "dualpipev"]
TWO_PER_RANK = ("zbv", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "dualpipev")


def two_ranks(schedule: str = "1f1b", **kw) -> tuple:
    stages = 4 if schedule in TWO_PER_RANK else 2
    options = (("stages_per_rank", 2),) if schedule in ("interleaved-1f1b", "looped-bfs", "interleaved-zb") else ()
    plan = Plan(schedule, stages, 2, 1, 4, tuple(7 * k for k in range(1, stages)),
                stages=tuple(StagePlan(k, 0, 0, 0) for k in range(stages)), schedule_options=options)
    return build_steps(models.loss_fn, PARAMS, BATCH, plan, **kw)


@pytest.mark.parametrize("schedule", ALL)
def test_a_step_leaves_nothing_behind_and_repeats_exactly(schedule: str) -> None:
    steps = two_ranks(schedule)
    for step in steps:  # what parallelize does on GPU before the first step; it must change nothing
        step.executor.warmup(step.local_stages)
        assert {kind for _, kind, _ in step.executor.parts} == {i.kind for i in step.program.instrs} & set(COMPUTE)
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
        if executor.program.rank == 1 and ins.kind == "backward":  # 1F1B runs B and W fused
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
    """The message a survivor prints (tests/engine/test_failures.py sees it end to end): which rank,
    which wait, how long, who to look at and what to check; the backend's text only in the cause."""
    t = DistTransport.__new__(DistTransport)  # only the message: no process group needed
    t.rank, t.timeout = 2, 10.0
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore")
    one = t._failure("receiving b4 (recv from rank 1)", gloo, (1,), 0.04)
    assert str(one) == (
        "rank 2: receiving b4 (recv from rank 1) failed after 0.0 s (timeout 10 s): rank 1 died or hangs; check its "
        "log for the error that stopped it (the connection closed: it exited, crashed or was killed, e.g. out of "
        "memory). If every rank is alive, check that all run the same script with the same inputs and options, "
        "and that one step's work fits in 10 s (parallelize(timeout=...)). The transport's own message is the "
        "chained cause.")
    slow = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms")
    many = t._failure("summing (all-reduce over ranks [0, 1, 2, 3])", slow, (0, 1, 3), 10.02)
    assert "summing (all-reduce over ranks [0, 1, 2, 3]) failed after 10.0 s (timeout 10 s)" in str(many)
    assert "one of ranks [0, 1, 3] died or hangs; check their logs" in str(many)
    assert "no answer within the timeout" in str(many)
    for err in (one, many):
        assert "gloo" not in str(err) and ".cc" not in str(err) and "third_party" not in str(err)


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


@pytest.mark.slow
@pytest.mark.parametrize("schedule,layout", [("1f1b", {}), ("zbv", {"stages": 2})])
def test_inductor_compiled_stage_programs_give_the_same_loss_and_grads(schedule: str, layout: dict) -> None:
    """`compiler="inductor"`: the same programs through torch.compile; float64 grads as torch.func.grad,
    with B and W fused (1f1b) and apart, the V's second stage handing its grads over on the rank (zbv):
    every weight grad is added into its accumulator inside a compiled program."""
    import engine
    from torch.utils import _pytree as pytree

    from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

    config = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, head_dim=16)
    params, (x, y), fn = init_params(config, torch.float64), example_batch(config, 4), make_loss_fn(config)
    step = engine.parallelize(fn, params, x, y, schedule=schedule, microbatches=2, compiler="inductor", **layout)
    loss, grads = step(step.shard(params), x, y)
    want_grads, want_loss = torch.func.grad_and_value(fn)(params, x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    got_leaves, want_leaves = pytree.tree_leaves(grads), pytree.tree_leaves(want_grads)
    assert len(got_leaves) == len(want_leaves) == len(pytree.tree_leaves(params))  # one rank holds every leaf
    for got, want in zip(got_leaves, want_leaves):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert not any(isinstance(getattr(f, "__self__", f), torch.fx.GraphModule)  # compiled, not fx's code
                   for f in step.executor.parts.values())
    # compiled inside parallelize (its warm-up), each local stage's compile timed
    assert set(step.compile_seconds) == set(step.local_stages) and min(step.compile_seconds.values()) > 0


@pytest.mark.slow
def test_inductors_cpp_wrapper_gives_the_same_loss_and_grads(monkeypatch) -> None:
    """FNPIPE_CPP_WRAPPER=1: the stage programs in inductor's C++ wrapper (kernels launched from C++), float64
    loss and every grad leaf as torch.func.grad, the weight grads added into the accumulators inside."""
    import engine
    from torch.utils import _pytree as pytree

    from engine.execution import compilers
    from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

    monkeypatch.setenv("FNPIPE_CPP_WRAPPER", "1")
    config = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, head_dim=16)
    params, (x, y), fn = init_params(config, torch.float64), example_batch(config, 4), make_loss_fn(config)
    step = engine.parallelize(fn, params, x, y, microbatches=2, compiler="inductor")
    loss, grads = step(step.shard(params), x, y)
    want_grads, want_loss = torch.func.grad_and_value(fn)(params, x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0)
    for got, want in zip(pytree.tree_leaves(grads), pytree.tree_leaves(want_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    parts = list(step.executor.parts.values())
    assert parts and all(isinstance(p.fn, compilers._Fallback) and p.fn.fn is not p.fn.second for p in parts)


def test_an_unknown_compiler_is_refused_naming_the_choices() -> None:
    import engine
    from engine.errors import PlanError

    with pytest.raises(PlanError, match="compiler must be one of 'fx', 'inductor', 'auto', got 'xla'"):
        engine.parallelize(lambda p, x: (p * x).sum(), torch.ones(2), torch.ones(4, 2), compiler="xla")


def _one_grad_for_three(p, x):  # type: ignore[no-untyped-def]
    h = torch.tanh(x @ p["w1"]).mean(0)    # [6]: no batch dim left
    h = h + p["b"] + p["b2"]               # autodiff returns one value as the grad of h, b and b2
    return (h * p["c"]).sum()              # linear after the mean: microbatch means average to the batch's


@pytest.mark.parametrize("schedule", ALL)
def test_one_value_that_is_the_grad_of_an_activation_and_of_params_reaches_each(schedule: str) -> None:
    """When autodiff returns a single value as the grad of a received activation and of two params (and
    the cotangent itself, at a cut right after the adds), every cut still gives torch.func.grad's
    grads: the params' copies are added into their accumulators and the activation's is sent on (the
    fused backward once kept only one of them and failed with KeyError 'g1')."""
    from engine.testing import assert_parallel_equivalent

    torch.manual_seed(0)
    params = {"w1": torch.randn(4, 6, dtype=torch.float64), "b": torch.randn(6, dtype=torch.float64),
              "b2": torch.randn(6, dtype=torch.float64), "c": torch.randn(6, dtype=torch.float64)}
    x = torch.randn(8, 4, dtype=torch.float64)
    n = len(ir.trace(_one_grad_for_three, params, x[:2]).eqns)
    stages = 4 if schedule in TWO_PER_RANK else 2
    for first in range(1, n - stages + 2):
        cuts = list(range(first, first + stages - 1))
        assert_parallel_equivalent(_one_grad_for_three, params, x, schedule=schedule, stages=stages,
                                   microbatches=4, cuts=cuts)
