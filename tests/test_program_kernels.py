"""benchmarks/program_kernels.py: a step's programs' kernels against the same programs timed in turn."""
from __future__ import annotations

import json

import pytest

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.program_kernels import Ranged, compare, gaps, ranges
from engine.execution.program import COMPUTE
from engine.execution.profile import program_label


def _trace(*parts: tuple[str, int, int, list[tuple[int, int]]]) -> list[dict]:
    """Chrome-trace events: per named range (label, cpu start, cpu duration, kernels as (device start, dur)),
    one launch call per kernel inside the range (runtime and driver calls in turn, as Triton's are), linked by
    correlation id; plus an NCCL kernel and a kernel
    launched outside every range, which must both be left out."""
    events, corr = [], 0
    for label, ts, dur, kernels in parts:
        events.append({"cat": "user_annotation", "name": label, "ts": ts, "dur": dur})
        for n, (kts, kdur) in enumerate(kernels):
            corr += 1
            launch = ("cuda_runtime", "cudaLaunchKernel") if n % 2 == 0 else ("cuda_driver", "cuLaunchKernel")
            events.append({"cat": launch[0], "name": launch[1], "ts": ts + n + 1, "dur": 1,
                           "args": {"correlation": corr}})
            events.append({"cat": "kernel", "name": f"gemm{n}", "ts": kts, "dur": kdur, "args": {"correlation": corr}})
    events += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10**6, "dur": 1, "args": {"correlation": 999}},
               {"cat": "kernel", "name": "stray", "ts": 10**6, "dur": 50, "args": {"correlation": 999}},
               {"cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 5, "dur": 900, "args": {"correlation": 1}},
               {"cat": "user_annotation", "name": "## Call CompiledFxGraph ##", "ts": 0, "dur": 10**7}]
    return events


def test_ranges_take_each_kernel_by_its_launch() -> None:
    """...and only a launch by the range's own thread: another thread's launch inside 0F's time is not 0F's."""
    events = _trace(("0F", 0, 100, [(200, 300), (600, 100)]), ("1B+", 1000, 100, [(1100, 400)]))
    events += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, "dur": 1, "tid": 7,
                "args": {"correlation": 77}},
               {"cat": "kernel", "name": "other", "ts": 700, "dur": 900, "args": {"correlation": 77}}]
    # 0F's gap (500-600 us) passed while the NCCL kernel (5-905 us) ran; its launch had returned long before
    assert ranges(events) == [Ranged("0F", 400e-6, 500e-6, 2, 0.0, 100e-6), Ranged("1B+", 400e-6, 400e-6, 1)]


def test_gaps_split_into_what_the_host_made_and_what_passed_beside_nccl() -> None:
    """Three kernels at 1000-1100, 1300-1400 and 1700-1800 us. The second's launch returned at 1250: of the
    200 us gap before it, 150 are the host's and 50 the device's, 30 of those (1250-1280) beside an NCCL kernel
    (1200-1280). The third's launch returned early; its 300 us gap overlaps the second NCCL kernel (1500-1900) for
    200: 230 beside NCCL, 120 neither."""
    events = [{"cat": "user_annotation", "name": "2W+", "ts": 900, "dur": 400}]
    for corr, (launch_end, start) in enumerate([(905, 1000), (1250, 1300), (1260, 1700)], start=1):
        events += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch_end - 2, "dur": 2,
                    "args": {"correlation": corr}},
                   {"cat": "kernel", "name": "gemm", "ts": start, "dur": 100, "args": {"correlation": corr}}]
    events += [{"cat": "kernel", "name": "ncclDevKernel_Recv", "ts": 1200, "dur": 80, "args": {"correlation": 50}},
               {"cat": "kernel", "name": "ncclDevKernel_Recv", "ts": 1500, "dur": 400, "args": {"correlation": 51}}]
    (run,) = ranges(events)
    assert run.label == "2W+" and run.count == 3 and run.gap_s == pytest.approx(500e-6)
    assert run.host_gap_s == pytest.approx(150e-6) and run.nccl_gap_s == pytest.approx(230e-6)
    turn = [Ranged("2W+", 300e-6, 350e-6, 3)]
    lines = [line.split() for line in gaps([run, run], turn).splitlines()]
    assert lines[1] == ["2W+", "2", "0.050", "0.500", "0.150", "0.230", "0.120"]
    assert lines[2] == ["all", "2", "0.100", "1.000", "0.300", "0.460", "0.240"]


def test_compare_sets_the_step_beside_the_programs_in_turn() -> None:
    """0F: kernels 1.10 x, span 1.25 x in the step (two runs); 1B+ as in turn; 2W was not timed in turn; the sum
    weights each timed program by its runs in the step: kernels (2 x 0.44 + 0.4) / (2 x 0.4 + 0.4) = 1.0667,
    span (2 x 0.6 + 0.5) / (2 x 0.48 + 0.5)."""
    in_turn = [Ranged("0F", 0.4e-3, 0.48e-3, 3), Ranged("0F", 0.4e-3, 0.48e-3, 3), Ranged("1B+", 0.4e-3, 0.5e-3, 2)]
    in_step = [Ranged("0F", 0.44e-3, 0.6e-3, 3), Ranged("0F", 0.44e-3, 0.6e-3, 3), Ranged("1B+", 0.4e-3, 0.5e-3, 2),
               Ranged("2W", 0.1e-3, 0.1e-3, 1)]
    lines = [line.split() for line in compare(in_step, in_turn).splitlines()]
    assert lines[1] == ["0F", "2", "0.400", "0.440", "1.100", "0.480", "0.600", "1.250"]
    assert lines[2] == ["1B+", "1", "0.400", "0.400", "1.000", "0.500", "0.500", "1.000"]
    assert lines[3] == ["2W", "1", "-", "0.100", "-", "-", "0.100", "-"]
    assert lines[4][:5] == ["all", "3", "1.200", "1.280", "1.067"] and lines[4][7] == f"{1.7 / 1.46:.3f}"


def test_a_step_with_annotate_names_every_compute_in_the_trace(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On CPU there are no kernels, but every compute's range is there, named after its program (one rank in
    this thread: the profiler records the thread it runs on)."""
    from tests.engine.test_observability import TINY, build_steps, example_batch, init_params, make_loss_fn, plan

    params, batch = init_params(TINY, torch.float32), example_batch(TINY, 8)
    fn = make_loss_fn(TINY)
    p = plan(fn, params, *batch, world_size=1, stages=1, schedule="1f1b", microbatches=4, device="cpu")
    (step,) = build_steps(fn, params, batch, p)
    local = step.shard(params)
    step(local, *batch)
    step.executor.annotate = True
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(local, *batch)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    names = [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "user_annotation"]
    expected = [program_label((i.stage, i.kind, i.accumulated())) for i in step.program.instrs if i.kind in COMPUTE]
    assert len(expected) == 8 and sorted(n for n in names if n in set(expected)) == sorted(expected)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step.profile_programs(*batch, passes=1)
    prof.export_chrome_trace(str(path))
    timed = [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "user_annotation"]
    programs = {program_label(p.key) for p in step.profile.programs}
    assert programs == set(expected) and all(timed.count(label) >= 4 for label in programs)  # in turn: reps + 1 rounds
