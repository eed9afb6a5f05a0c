"""engine.execution.compilers: "auto" picks by device, identical programs compile once, the cache directory."""
from __future__ import annotations

import logging
import os

import pytest
import torch

import engine
import ir
from engine.errors import PlanError
from engine.execution import compilers
from examples.gpt_model import GPTConfig, example_batch, init_params, make_loss_fn

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, head_dim=8)


def test_auto_is_inductor_on_cuda_and_fx_elsewhere() -> None:
    assert compilers.resolve("auto", "cuda") == "inductor" and compilers.resolve("auto", torch.device("cuda:1")) == "inductor"
    assert compilers.resolve("auto", "cpu") == "fx" and compilers.resolve("auto", "mps") == "fx"
    assert compilers.resolve("fx", "cuda") == "fx" and compilers.resolve("inductor", "cpu") == "inductor"
    with pytest.raises(ValueError, match="compiler must be one of 'fx', 'inductor', 'auto', got 'tvm'"):
        compilers.resolve("tvm", "cpu")


def test_the_default_step_on_cpu_runs_fx_programs_and_compiles_nothing() -> None:
    params, batch = init_params(TINY, torch.float64), example_batch(TINY, 4)
    fn = make_loss_fn(TINY)
    step = engine.parallelize(fn, params, *batch, microbatches=2)  # compiler="auto"
    assert step.executor.compiler == "fx"
    loss, grads = step(step.shard(params), *batch)
    want = torch.func.grad(fn)(params, *batch)
    for got, ref in zip(torch.utils._pytree.tree_leaves(grads), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)
    assert step.compile_seconds == {}
    assert all(isinstance(f.__self__, torch.fx.GraphModule) for f in step.executor.parts.values())  # fx's code




def test_identical_programs_share_one_compiled_callable() -> None:
    """Programs that print alike (with equal constants) map to one compiled callable per process, so a
    model of identical layers compiles each kind of stage once; others do not share."""
    graph = ir.trace(lambda p, x: torch.tanh(x @ p).sum(), torch.randn(4, 4), torch.randn(2, 4))
    again = ir.trace(lambda p, x: torch.tanh(x @ p).sum(), torch.randn(4, 4), torch.randn(2, 4))
    other = ir.trace(lambda p, x: torch.sigmoid(x @ p).sum(), torch.randn(4, 4), torch.randn(2, 4))
    assert graph is not again and str(graph) == str(again)
    assert compilers.program_key(graph, ()) == compilers.program_key(again, ())
    assert compilers.program_key(graph, ()) != compilers.program_key(graph, (0,))
    assert compilers.program_key(graph, ()) != compilers.program_key(other, ())
    assert compilers.inductor(graph, ()) is compilers.inductor(again, ())  # torch.compile is lazy: no compile here
    assert compilers.inductor(graph, ()) is not compilers.inductor(other, ())


def test_constants_are_part_of_the_key() -> None:
    def with_constant(c: float):  # noqa: ANN202
        return ir.trace(lambda x: (x * torch.tensor([c, 1.0])).sum(), torch.randn(3, 2))

    a, b = with_constant(2.0), with_constant(3.0)
    assert compilers.program_key(a, ()) != compilers.program_key(b, ())
    assert compilers.program_key(a, ()) == compilers.program_key(with_constant(2.0), ())


def test_the_compile_log_times_first_calls_and_marks_shared_programs() -> None:
    calls = []

    def fake(graph: ir.Graph, acc: tuple) -> object:
        calls.append(graph)
        return lambda *xs: sum(xs)

    graph = ir.trace(lambda x: torch.cos(x).sum(), torch.randn(3))
    again = ir.trace(lambda x: torch.cos(x).sum(), torch.randn(3))
    log = compilers.CompileLog()
    f0, f1 = log.wrap(fake, 0, "forward", graph, ()), log.wrap(fake, 1, "forward", again, ())
    assert f0(1, 2) == 3 and f0(3, 4) == 7 and f1(5, 6) == 11
    assert set(log.times) == {(0, "forward"), (1, "forward")}
    assert not log.times[(0, "forward")].shared and log.times[(1, "forward")].shared
    assert set(log.per_stage()) == {0, 1} and all(t >= 0 for t in log.per_stage().values())
    assert log.wrap(ir.compile_graph, 2, "forward", graph, ()) is ir.compile_graph(graph)  # fx: nothing to time
    assert (2, "forward") not in log.times


def test_the_disk_cache_goes_beside_the_plans_unless_the_user_chose(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compilers.use_cache_dir(None) is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert compilers.use_cache_dir(tmp_path / "plans") == str((tmp_path / "plans" / "inductor").resolve())
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "plans" / "inductor").resolve())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compilers.use_cache_dir(tmp_path / "plans") == str(tmp_path / "mine")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compilers.use_cache_dir(tmp_path / "deploy.json") == str((tmp_path / "inductor").resolve())


def test_cpp_wrapper_switch_keys_its_own_program_and_refuses_what_it_cannot_mean(monkeypatch) -> None:
    """FNPIPE_CPP_WRAPPER picks inductor's C++ wrapper: a program compiled both ways in one process is two
    callables (never the other's), and a value it cannot mean is a PlanError naming the fix."""
    graph = ir.trace(lambda p, x: torch.tanh(x @ p).sum(), torch.randn(4, 4), torch.randn(2, 4))
    monkeypatch.delenv("FNPIPE_CPP_WRAPPER", raising=False)
    assert not compilers.cpp_wrapper()
    python = compilers.inductor(graph, ())
    monkeypatch.setenv("FNPIPE_CPP_WRAPPER", "1")
    assert compilers.cpp_wrapper()
    cpp = compilers.inductor(graph, ())
    assert cpp is not python and isinstance(cpp, compilers._Fallback) and cpp is compilers.inductor(graph, ())
    monkeypatch.setenv("FNPIPE_CPP_WRAPPER", "maybe")
    with pytest.raises(PlanError, match="FNPIPE_CPP_WRAPPER='maybe': set it to 1"):
        compilers.cpp_wrapper()
    with pytest.raises(PlanError, match="FNPIPE_CPP_WRAPPER"):
        engine.init()


def test_a_cpp_wrapper_that_fails_to_compile_falls_back_to_the_python_wrapper() -> None:
    """The C++-wrapped program's BackendCompilerFailed (raised before any kernel ran) hands the call, and every
    later one, to the Python-wrapped program, with a warning; any other error is the caller's."""
    from torch._dynamo.exc import BackendCompilerFailed

    calls = []

    def broken(*args):  # noqa: ANN202
        calls.append("cpp")
        failed = BackendCompilerFailed.__new__(BackendCompilerFailed)  # its __init__'s arguments vary by version
        Exception.__init__(failed, "backend='inductor' raised: no C++ compiler")
        raise failed

    def python(*args):  # noqa: ANN202
        calls.append("python")
        return sum(args)

    fn = compilers._Fallback(broken, python)
    records: list[logging.LogRecord] = []
    handler, logger = logging.Handler(logging.WARNING), logging.getLogger("engine.compile")
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        assert fn(1, 2) == 3 and fn(3, 4) == 7
    finally:
        logger.removeHandler(handler)
    assert calls == ["cpp", "python", "python"]
    assert ["C++ wrapper failed to compile" in r.getMessage() for r in records] == [True]

    def oom(*args):  # noqa: ANN202
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        compilers._Fallback(oom, python)(1)
