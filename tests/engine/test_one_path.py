"""One path from plan to program: each expensive pass runs once per `parallelize`, and every caller assembles alike."""
from __future__ import annotations

import json
import re
import sys

import pytest
import torch

import engine
from engine.execution import assemble as assemble_mod
from engine.execution.inprocess import build_steps, run_steps
from engine.planning.search import search
from engine.testing import _cache
from tests.mpi import passes
from tests.mpi.jobs import BIN, job_env, launch


def _records(out: str) -> dict[tuple[int, str], dict]:
    return {(int(r), case): json.loads(body)
            for r, case, body in re.findall(r"^PASSES rank (\d+) (\S+) (\{.*\})$", out, flags=re.M)}


@pytest.fixture(scope="module")
def two_ranks() -> str:
    cmd = [str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
           "tests/mpi/passes.py"]
    return launch(cmd, timeout=300, env=job_env())


@pytest.mark.mpi
def test_parallelize_traces_once_differentiates_each_stage_once_and_emits_only_its_rank(two_ranks: str) -> None:
    recs = _records(two_ranks)
    assert set(recs) == {(r, c) for r in range(2) for c in ("given_cuts", "split_by_the_planner", "given_cuts_again")}, \
        two_ranks
    for rank in range(2):
        given = recs[(rank, "given_cuts")]
        assert given["num_stages"] == 2
        assert given["trace"] == 1, given                       # one trace of the microbatch graph
        # each stage differentiated once for its costs and once for the programs it runs (both on joints
        # stitched from its blocks', on the planner's and on the graph's bounds); no joint is traced twice
        assert given["distinct_stage_autodiff"] == 2 and given["stage_autodiff"] <= 4, given
        assert given["trace_joint"] == given["distinct_trace_joint"] > 0, given
        assert given["emitted_for"] == [rank], given             # this rank's program only
        assert given["registry_get"] == 1 and given["lower"] == 1 and given["simulate"] == 1, given
        auto = recs[(rank, "split_by_the_planner")]
        assert auto["trace"] == 1 and auto["emitted_for"] == [rank] and auto["lower"] == 1, auto
        assert auto["registry_get"] == 1, auto
        # the splitter differentiates blocks and candidate stages to cost them on stitched joints, the chosen
        # stages run the same; no joint is traced twice
        assert auto["stage_autodiff"] <= 2 * auto["distinct_stage_autodiff"], auto
        assert auto["trace_joint"] == auto["distinct_trace_joint"] > 0, auto
        # the same model planned again in the process: its stages differentiated, no joint traced (shared joints)
        again = recs[(rank, "given_cuts_again")]
        assert again.get("trace_joint", 0) == 0 and again["stage_autodiff"] == given["stage_autodiff"], (again, given)
    assert two_ranks.count("OK rank") == 6, two_ranks


def test_the_counter_sees_a_second_trace() -> None:
    """The counting must be able to fail: tracing again while counting is seen."""
    c = passes.counting()
    try:
        params = {"layers": [torch.randn(4, 4)]}
        x = torch.randn(2, 4)
        import ir
        ir.trace(passes.mlp_loss, params, x, x)
        ir.trace(passes.mlp_loss, params, x, x)
    finally:
        c.restore()
    assert c.calls["trace"] == 2


def test_the_harness_the_inprocess_runner_and_a_step_run_the_programs_assemble_makes(monkeypatch) -> None:
    """Every caller goes through `assemble`: the in-process runner and engine.testing assemble each rank once."""
    seen: list[int] = []
    real = assemble_mod.assemble

    def counted(planned, rank):  # type: ignore[no-untyped-def]
        seen.append(rank)
        return real(planned, rank)

    monkeypatch.setattr(assemble_mod, "assemble", counted)
    import engine.execution.inprocess as inprocess_mod
    monkeypatch.setattr(inprocess_mod, "assemble", counted)
    params = {"layers": [torch.randn(8, 8, dtype=torch.float64) / 3 for _ in range(3)]}
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    planned = search(passes.mlp_loss, params, x, y, world_size=2, stages=2, microbatches=2)
    result = run_steps(build_steps(passes.mlp_loss, params, (x, y), planned), params, (x, y))
    assert seen == [0, 1]
    ref = torch.func.grad(passes.mlp_loss)(params, x, y)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=0) for a, b in zip(result.grads["layers"], ref["layers"]))
    seen.clear()
    _cache._WORKSHOPS.clear()
    engine.testing.assert_parallel_equivalent(passes.mlp_loss, params, x, y, schedule="1f1b", stages=2,
                                              microbatches=2)
    assert seen == [0, 1]


def test_stages_that_print_alike_share_their_programs(monkeypatch) -> None:
    """Four stages of one layer each: the two middle ones are one graph, differentiated once, and the
    pipeline still computes torch.func.grad."""
    import ir

    calls: list[str] = []
    real = ir.stage_autodiff
    monkeypatch.setattr(ir, "stage_autodiff", lambda g, **kw: (calls.append(str(g)), real(g, **kw))[1])
    params = {"layers": [torch.randn(8, 8, dtype=torch.float64) / 3 for _ in range(4)]}
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    graph = ir.trace(passes.mlp_loss, params, x[:2], y[:2])
    cuts = [k for k, e in enumerate(graph.eqns) if e.op.startswith("aten.tanh")][:3]
    calls.clear()
    planned = search(passes.mlp_loss, params, x, y, world_size=4, cuts=[c + 1 for c in cuts], microbatches=4,
                     schedule="1f1b")
    ads = [info.ad for info in planned.stages]
    assert ads[1] is ads[2] and len({id(a) for a in ads}) == 3, [len(s.stage.graph.eqns) for s in planned.stages]
    # stage 0 prints like the middle ones but its input is batch (constant): its own; each once for its costs and
    # once for the programs it runs
    assert 3 <= len(calls) <= 6, len(calls)
    result = run_steps(build_steps(passes.mlp_loss, params, (x, y), planned), params, (x, y))
    ref = torch.func.grad(passes.mlp_loss)(params, x, y)
    assert all(torch.allclose(a, b, rtol=1e-10, atol=0) for a, b in zip(result.grads["layers"], ref["layers"]))
