"""Multi-process runs over gloo: loss and every grad leaf equal `torch.func.grad` on one process.

One `mpirun` launch per world size runs every configuration of tests/mpi/equivalence.py (each built-in
schedule, with and without data parallel, tied weights and a skip across stages, float64 and float32);
torchrun and plain python run tests/mpi/launchers.py and must agree with each other to the last bits
that the reduction order allows.
"""
from __future__ import annotations

import re
import sys

import pytest

import ir
from engine.planning.search import plan
from engine.execution.step import microbatch_example
from tests.mpi import equivalence, launchers, models
from tests.mpi.jobs import BIN, free_port, job_env, launch

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_schedule_matches_torch_func_grad_under_mpirun(ranks: int) -> None:
    cmd = [str(BIN / "mpirun"), "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable,
           "tests/mpi/equivalence.py"]
    out = launch(cmd, timeout=400, env=dict(job_env(), FNPIPE_HANG_DUMP="360"))  # a hang prints its stacks
    ok = re.findall(r"^OK rank (\d+) (\{.*?\}) (float\d+) max rel err", out, flags=re.M)
    cfgs = equivalence.configs(ranks)
    expected = {(str(r), str(c), d) for r in range(ranks) for c in cfgs for d in ("float64", "float32")}
    assert len(expected) == ranks * len(cfgs) * 2 == 32 * ranks  # 8 schedules x (dp 1, dp 2) x 2 dtypes
    assert "FAIL" not in out, out
    assert len(ok) == len(expected) and set(ok) == expected, f"missing {sorted(expected - set(ok))}:\n{out}"


def _records(out: str) -> dict[tuple[int, int, str], tuple[float, dict[str, float]]]:
    """(world, rank, schedule) -> (loss, {leaf name: squared grad norm}) from launchers.py's lines."""
    assert "FAIL" not in out, out
    recs = {}
    for world, rank, sched, loss, norms in re.findall(
            r"OK world (\d+) rank (\d+) (\S+) stages \d+ max rel err \S+ loss (\S+) grad sq (\S+)", out):
        leaves = dict(kv.split("=") for kv in norms.split(","))
        recs[(int(world), int(rank), sched)] = (float.fromhex(loss), {k: float.fromhex(v) for k, v in leaves.items()})
    return recs


def test_torchrun_and_plain_python_give_the_same_numbers() -> None:
    schedules = [c["schedule"] for c in launchers.configs(1)]
    port = free_port()
    two = _records(launch([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master-port", str(port),
                           "tests/mpi/launchers.py"], timeout=240))
    one = _records(launch([sys.executable, "tests/mpi/launchers.py"], timeout=240))
    assert set(two) == {(2, r, s) for r in range(2) for s in schedules}, two.keys()
    assert set(one) == {(1, 0, s) for s in schedules}, one.keys()
    ref_loss, ref_sq = one[(1, 0, "1f1b")]
    assert len(ref_sq) == 14  # every leaf of the model: the one-process run holds them all
    for (world, rank, sched), (loss, sq) in {**one, **two}.items():
        assert loss == pytest.approx(ref_loss, rel=1e-13), (world, rank, sched)
        assert sq and all(v == pytest.approx(ref_sq[k], rel=1e-12) for k, v in sq.items()), (world, rank, sched, sq)
    for sched in schedules:  # the two ranks together hold every leaf
        held = [set(two[(2, r, sched)][1]) for r in range(2)]
        assert held[0] | held[1] == set(ref_sq), (sched, held)
    # 1f1b puts the tied embedding on both ranks (first and last stage); zbv's V puts both ends on rank 0
    assert "embed" in set(two[(2, 0, "1f1b")][1]) & set(two[(2, 1, "1f1b")][1])


def test_the_model_has_a_skip_across_stages_and_a_tied_weight_on_two_stages() -> None:
    """What makes the equivalence runs above worth having: the plans they get cut the model so that."""
    params, batch = models.init_params(layers=4), models.batch(size=16)
    for world, stages in ((2, 2), (4, 4)):
        p = plan(models.loss_fn, params, *batch, world_size=world, schedule="1f1b", microbatches=4)
        graph = ir.trace(models.loss_fn, params, *microbatch_example(batch, 4), device="cpu")
        parts = ir.split(graph, p.cuts)
        assert len(parts) == stages
        assert max(len(s.acts_in) for s in parts) == 2  # the running activation and the skip
        embed = graph.input_names.index("embed")
        assert [s.index for s in parts if embed in s.param_ids] == [0, stages - 1]  # embedding and tied head
