"""The harness's public API: plans() draws only valid layouts, PlanSpec, reports, tolerances, plugin, example."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules
from engine.errors import InputError, PlanError
from engine.testing import (
    RTOL, ModelCase, ParallelMismatch, PlanSpec, assert_parallel_equivalent, build, faults, format_stats, plans,
)
from engine.testing.mismatch import PROGRAM_HEAD, PROGRAM_TAIL, format_failure
from engine.testing.models import Layer, ModelSpec
from engine.testing.plans import weights_to_cuts
from schedules import Table, registry

pytest_plugins = ["engine.testing.pytest_plugin"]  # the fnpipe_check fixture and the checks summary

ROOT = Path(__file__).resolve().parents[2]
QUICK = settings(max_examples=300, deadline=None, database=None)


# ---------------------------------------------------------------- plans()


@QUICK
@given(plans(batch_size=12, max_microbatches=6))
def test_plans_are_valid_layouts(spec: PlanSpec) -> None:
    assert spec.schedule in schedules.names()
    assert spec.world_size in (1, 2, 4) and spec.dp in (1, 2) and spec.world_size % spec.dp == 0
    assert 12 % (spec.microbatches * spec.dp) == 0
    p = spec.pipeline_depth
    if spec.schedule in ("zbv", "dualpipev"):
        assert spec.stages_per_rank == 2
        assert spec.schedule == "zbv" or spec.microbatches >= 2 * p  # DeepSeek's order needs m >= 2p
    elif spec.schedule == "interleaved-1f1b":
        assert spec.microbatches % p == 0
    elif spec.schedule not in ("looped-bfs", "interleaved-zb"):
        assert spec.stages_per_rank == 1
    table = schedules.get(spec.schedule)(spec.stages, spec.microbatches, **dict(spec.schedule_options))
    assert table.num_ranks == p and table.num_stages == spec.stages
    schedules.validate(schedules.lower(table))
    assert (spec.cuts, spec.weights).count(None) >= 1


@QUICK
@given(plans(num_eqns=9, cuts="drawn"))
def test_plans_with_eqn_count_draw_explicit_cuts(spec: PlanSpec) -> None:
    assert spec.stages <= 9 and spec.weights is None
    assert spec.cuts is not None and len(spec.cuts) == spec.stages - 1
    assert list(spec.cuts) == sorted(set(spec.cuts)) and all(0 < c < 9 for c in spec.cuts)


def _one_rank(num_stages: int, num_microbatches: int, **options: object) -> Table:
    rows = [[f"{s}F{i}" for s in range(num_stages) for i in range(num_microbatches)]
            + [f"{s}BW{i}" for s in reversed(range(num_stages)) for i in range(num_microbatches)]]
    return Table.from_rows(rows, stage_to_rank=[0] * num_stages, num_microbatches=num_microbatches)


@pytest.fixture
def one_rank_schedule(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    schedules.register("test-one-rank", _one_rank)
    yield "test-one-rank"


def test_plans_draw_registered_schedules_with_the_ranks_they_build(one_rank_schedule: str) -> None:
    """Registered after the strategy was made; its tables have one rank, so only world 1 (or dp) fits."""
    seen: list[PlanSpec] = []

    @settings(max_examples=150, deadline=None, database=None)
    @given(plans(schedules=(one_rank_schedule, "gpipe")))
    def draw(spec: PlanSpec) -> None:
        seen.append(spec)

    draw()
    mine = [s for s in seen if s.schedule == one_rank_schedule]
    assert mine and all(s.pipeline_depth == 1 and s.stages == 1 for s in mine)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(12, 200))
def test_weights_to_cuts(weights: list[int], n: int) -> None:
    cuts = weights_to_cuts(weights, n)
    assert len(cuts) == len(weights) - 1
    assert all(a < b for a, b in zip((0, *cuts), (*cuts, n))) and all(0 < c < n for c in cuts)


def test_equal_weights_split_evenly() -> None:
    assert weights_to_cuts((1, 1, 1, 1), 20) == (5, 10, 15)
    assert weights_to_cuts((3, 1), 8) == (6,)


def test_plan_spec_errors_and_str() -> None:
    with pytest.raises(PlanError, match="cuts or weights, not both"):
        PlanSpec("1f1b", 2, 2, cuts=(3,), weights=(1, 1))
    with pytest.raises(PlanError, match="1 cuts make 2 stages, not 3"):
        PlanSpec("1f1b", 3, 2, cuts=(3,))
    with pytest.raises(PlanError, match="do not split into 2 per rank"):
        PlanSpec("zbv", 3, 2, stages_per_rank=2)
    with pytest.raises(PlanError, match="4 stages need at least 4 equations; the model has 3"):
        PlanSpec("zbv", 4, 2, stages_per_rank=2).resolve_cuts(3)
    spec = PlanSpec("zbv", 4, 8, dp=2, stages_per_rank=2, weights=(1, 2, 1, 1))
    assert str(spec) == "zbv: 4 stages (2 per rank) on 2 ranks x dp 2, 8 microbatches, stage weights 1:2:1:1"
    assert spec.world_size == 4 and spec.schedule_options == ()
    assert PlanSpec("interleaved-1f1b", 6, 3, stages_per_rank=3).schedule_options == (("stages_per_rank", 3),)


# ---------------------------------------------------------------- the check and its report


def _case() -> ModelCase:
    spec = ModelSpec(layers=(Layer("linear", width=8, act="tanh"), Layer("residual", width=8, act="gelu"),
                             Layer("layernorm")), tokens=False, d_in=4, vocab=3, embed_op="embedding", head="mse",
                     tied=False, outputs=2, batch_size=8, seq=2, z_width=0)
    return build(spec, dtype=torch.float64, seed=1)


def test_passing_check_reports_its_numbers() -> None:
    result = assert_parallel_equivalent(_case(), schedule="zbv", stages=4, microbatches=4)
    assert result.plan.schedule == "zbv" and result.plan.world_size == 2 and not result.distributed
    assert result.max_rel_error <= 1e-10 and result.leaves == 8
    assert abs(result.loss - result.expected_loss) <= 1e-12 * abs(result.expected_loss)


def test_failure_report_names_model_plan_programs_and_leaf() -> None:
    case = _case()
    with pytest.raises(ParallelMismatch) as caught:
        assert_parallel_equivalent(case, schedule="1f1b", stages=2, microbatches=2, cuts=(4,),
                                   hook=faults.ScaleGrad(rank=0, factor=3.0, leaf=0))
    text = str(caught.value)
    assert isinstance(caught.value, AssertionError)
    assert text.startswith("grads (1 of 8 leaves) differ from torch.func.grad_and_value(fn) on the full batch\n")
    assert "first differing leaf 'layers.0.w' (float64): max abs err" in text
    assert "expected [" in text and "actual   [" in text
    assert f"model: {case.description}" in text
    assert "plan spec: 1f1b: 2 stages on 2 ranks x dp 1, 2 microbatches, cuts [4]" in text
    assert "1f1b: 2 stages on 2 ranks x dp 1 = 2 ranks" in text  # str(plan)
    assert "program rank 0 (" in text and "program rank 1 (" in text


def test_long_programs_are_truncated() -> None:
    class Listing:
        def __str__(self) -> str:
            return "\n".join(["program rank 0 (500 instructions)"] + [f"  {i:4d}: free [b{i}]" for i in range(500)])

    text = format_failure("x", description=None, spec=None, plan=None, programs=[Listing()])
    lines = text.splitlines()
    assert len(lines) == 1 + PROGRAM_HEAD + 1 + PROGRAM_TAIL
    assert f"... {501 - PROGRAM_HEAD - PROGRAM_TAIL} instructions omitted ..." in text and lines[-1].endswith("[b499]")


def test_unread_param_has_zero_grad_both_ways() -> None:
    fn = lambda p, x: (x @ p["w"]).square().mean()  # noqa: E731 -- p["unused"] is never read
    params = {"w": torch.randn(3, 2, dtype=torch.float64), "unused": torch.randn(5, dtype=torch.float64)}
    assert_parallel_equivalent(fn, params, torch.randn(8, 3, dtype=torch.float64), schedule="gpipe", stages=2)


def test_model_case_goes_alone() -> None:
    case = _case()
    with pytest.raises(TypeError, match="pass a ModelCase alone"):
        assert_parallel_equivalent(case, case.params, *case.batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_tolerances_hold_for_low_precision(dtype: torch.dtype) -> None:
    case = build(_case().spec, dtype=dtype, seed=2)  # type: ignore[arg-type]
    result = assert_parallel_equivalent(case, schedule="interleaved-1f1b", stages=4, microbatches=4)
    assert result.max_rel_error <= RTOL[dtype]
    assert RTOL == {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_format_stats_counts_by_schedule() -> None:
    from collections import Counter

    from engine.testing.harness import Checked

    text = format_stats(Counter({Checked("zbv", 2, 1, "float64"): 3, Checked("zbv", 4, 2, "float32"): 1}))
    assert text == "fnpipe equivalence checks: 4\n  zbv: 4 (w2/dp1/float64 3, w4/dp2/float32 1)"


# ---------------------------------------------------------------- the pytest plugin and the example


@pytest.fixture
def _loose(request: pytest.FixtureRequest) -> None:
    request.node.add_marker(pytest.mark.fnpipe(rtol=1e-5))


def test_fixture_takes_marker_defaults(_loose: None, fnpipe_check: Any) -> None:
    case = _case()
    fnpipe_check(case, schedule="1f1b", stages=2, microbatches=2, hook=faults.ScaleGrad(rank=0, factor=1 + 1e-6))
    with pytest.raises(ParallelMismatch):
        fnpipe_check(case, schedule="1f1b", stages=2, microbatches=2, rtol=1e-10,
                     hook=faults.ScaleGrad(rank=0, factor=1 + 1e-6))


def test_example_runs_as_a_script() -> None:
    env = {**os.environ, "CHECK_MY_MODEL_EXAMPLES": "4", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "check_my_model.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "fnpipe equivalence checks: 4" in out.stdout
    assert out.stdout.rstrip().endswith("ok (in one process): every drawn plan matched torch.func.grad")


MPIRUN = ROOT / ".venv" / "bin" / "mpirun"
MPI_SCRIPT = """
import examples.check_my_model as ex
from engine.testing import ParallelMismatch, assert_parallel_equivalent, faults, format_stats, in_distributed_job
ex.test_my_model_is_pipeline_equivalent()
print("distributed:", in_distributed_job(), format_stats().splitlines()[0])
try:
    assert_parallel_equivalent(ex.loss_fn, ex.PARAMS, ex.TOKENS, ex.TARGETS, schedule="1f1b", stages=2,
                               microbatches=4, hook=faults.DropWeightGrad(rank=1))
except ParallelMismatch as err:
    print("caught:", str(err).splitlines()[0])
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_under_mpirun_the_real_runtime_is_checked() -> None:
    """Two ranks (gloo): the example's property passes on both; a dropped W on rank 1 fails on both ranks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHECK_MY_MODEL_EXAMPLES": "6", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run([str(MPIRUN), "-n", "2", "--oversubscribe", sys.executable, "-c", MPI_SCRIPT], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("distributed: True fnpipe equivalence checks: 6") == 2, out.stdout
    # The tied embedding's grad is summed over both ranks, so both see the dropped W.
    assert out.stdout.count("caught: rank 0 (of ranks [0, 1] that differ) reports: grads (") == 2, out.stdout


def test_plan_spec_to_plan_directly_or_through_the_planner() -> None:
    case = _case()
    spec = PlanSpec("zbv", 4, 2, stages_per_rank=2, weights=(1, 1, 2, 1))
    direct = spec.to_plan(case.fn, case.params, *case.batch)
    planned = spec.to_plan(case.fn, case.params, *case.batch, planner=True)
    assert direct.cuts == planned.cuts and len(direct.cuts) == 3
    for plan in (direct, planned):
        assert (plan.schedule, plan.num_stages, plan.pipeline_depth, plan.dp, plan.microbatches) == ("zbv", 4, 2, 1, 2)
        assert [s.rank for s in plan.stages] == [0, 1, 1, 0] and plan.microbatch_size == 4
    assert planned.predicted_step_time > 0 and direct.stages[0].names == planned.stages[0].names


@pytest.mark.parametrize("loss_dtype", [torch.float64, torch.float32])
def test_a_mismatch_from_a_coarser_dtype_inside_says_so(loss_dtype: torch.dtype) -> None:
    """A float64 model whose norm computes in float32 (Gemma's RMSNorm): microbatches round differently from
    the full batch at ~1e-8, above float64's 1e-10; the report names the float32 ops and the rtol to pass."""
    def fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ p["w1"])
        h32 = h.float()
        # g's grad is a float32 sum over the rows: the microbatches round it differently from the full batch
        h = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6) * p["g"].float()).double()
        return torch.nn.functional.mse_loss(h @ p["w2"], y).to(loss_dtype)  # transformers returns a float32 loss

    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(6, 16, generator=g, dtype=torch.float64), "g": torch.ones(16, dtype=torch.float64),
              "w2": torch.randn(16, 2, generator=g, dtype=torch.float64)}
    x, y = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randn(16, 2, generator=g, dtype=torch.float64)
    with pytest.raises(ParallelMismatch, match=r"note: the function computes \d+ values in float32 .* pass rtol=1e-06"):
        assert_parallel_equivalent(fn, params, x, y, microbatches=4, stages=2)
    assert assert_parallel_equivalent(fn, params, x, y, microbatches=4, stages=2, rtol=1e-6).max_rel_error < 1e-6


def test_the_reference_takes_an_autograd_function_torch_func_cannot_transform() -> None:
    """BLOOM's GeLUFunction has no setup_context, so torch.func refuses it; the reference then runs through
    torch.autograd and the check still compares (the pipeline traces it as any op)."""
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x ** 3

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return 3 * x * x * g

    def fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = Cube.apply(torch.tanh(x @ p["w1"]))
        return torch.nn.functional.mse_loss(h @ p["w2"], y)

    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(6, 8, generator=g, dtype=torch.float64),
              "w2": torch.randn(8, 2, generator=g, dtype=torch.float64)}
    x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda p: fn(p, x, y))(params)
    assert assert_parallel_equivalent(fn, params, x, y, microbatches=4, stages=2).max_rel_error < 1e-12


def _two_towers() -> tuple[dict, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    params = {"wa": torch.randn(6, 4, generator=g, dtype=torch.float64),
              "wb": torch.randn(5, 4, generator=g, dtype=torch.float64)}
    return params, torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 5, generator=g, dtype=torch.float64)


def test_a_loss_that_compares_rows_is_refused_before_the_harness_runs_it() -> None:
    """A contrastive loss (every row against every other, as CLIP's) is not a mean over the batch: planning a cut
    batch refuses it (engine/planning/rows.py), and the whole batch as one microbatch equals torch.func."""
    def clip_like(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = torch.tanh(x @ p["wa"]), torch.tanh(y @ p["wb"])
        logits = a @ b.t()
        target = torch.arange(len(x))
        return torch.nn.functional.cross_entropy(logits, target)

    params, x, y = _two_towers()
    with pytest.raises(InputError, match=r"compares rows of the batch(.|\n)*logits = a @ b.t\(\)"):
        assert_parallel_equivalent(clip_like, params, x, y, microbatches=4, stages=2)
    assert assert_parallel_equivalent(clip_like, params, x, y, microbatches=1, stages=2).max_rel_error < 1e-12


def test_a_loss_that_compares_rows_unseen_by_planning_is_named_as_not_a_mean() -> None:
    """Rows compared through a constant pick (each row against its mirror, `flip(0)`) are not followed by the
    planner's check (ir/batch_rows.py says so); the harness's report still says why the losses differ."""
    def mirrored(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(x @ p["wa"])
        return ((a - a.flip(0)) ** 2).mean() + (torch.tanh(y @ p["wb"]) ** 2).mean()

    params, x, y = _two_towers()
    with pytest.raises(ParallelMismatch, match="compares rows with each other"):
        assert_parallel_equivalent(mirrored, params, x, y, microbatches=4, stages=2)
    assert_parallel_equivalent(mirrored, params, x, y, microbatches=1, stages=2)
