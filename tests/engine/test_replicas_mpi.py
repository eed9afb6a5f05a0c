"""Unequal replicas per stage under mpirun: loss and every grad leaf equal `torch.func.grad` (float64).

One launch per world size runs every schedule of tests/mpi/replicas.py: 3 ranks as stage 0 x 2 +
stage 1 x 1, 4 ranks as stage 0 x 2 + stages 1 and 2 x 1 (and 1f1b as 1 x 3), with tied weights
and a skip across stages, the replica order (split / own) as the planner chose it; then `step.evaluate` of a
BatchNorm net on each replica layout.
"""
from __future__ import annotations

import re
import sys

import pytest

from tests.mpi import replicas
from tests.mpi.jobs import BIN, job_env, launch

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [3, 4])
def test_unequal_replicas_match_torch_func_grad_under_mpirun(ranks: int) -> None:
    cmd = [str(BIN / "mpirun"), "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable,
           "tests/mpi/replicas.py"]
    out = launch(cmd, timeout=400, env=dict(job_env(), FNPIPE_HANG_DUMP="360"))
    ok = re.findall(r"^OK rank (\d+) (\S+) replicas (\(.*?\)) (\w+) order max rel err", out, flags=re.M)
    cfgs = replicas.configs(ranks)
    expected = {(str(r), c["schedule"], str(c["replicas"])) for r in range(ranks) for c in cfgs}
    assert "FAIL" not in out, out
    assert {(r, s, c) for r, s, c, _ in ok} == expected and len(ok) == len(expected), out
    assert {order for *_, order in ok} <= {"split", "own"}
    evals = re.findall(r"^EVAL OK rank (\d+) replicas (\(.*?\)) max abs err", out, flags=re.M)
    assert sorted(evals) == sorted({(str(r), str(c["replicas"])) for r in range(ranks) for c in cfgs}), out
