"""The wait after the stage programs compile has its own bound: a slow compile is not a dead peer."""
from __future__ import annotations

import re
import sys

import pytest

from tests.mpi.jobs import BIN, job_env, launch

pytestmark = pytest.mark.mpi


def test_a_compile_longer_than_the_step_timeout_is_waited_out_under_mpirun() -> None:
    out = launch([str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                  "tests/mpi/compile_wait.py"], timeout=120, env=job_env())
    rows = re.findall(r"^WAITED rank (\d) ([\d.]+) (.*)$", out, flags=re.M)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], out
    for _, waited, values in rows:
        assert float(waited) >= 6.0, out  # rank 0 waited the whole 3 x 2 s for rank 1 (rank 1 slept it)
        assert values == "[{'rank': 0}, {'rank': 1}] [0, 1]", out


def test_rank_0_calibrating_longer_than_the_step_timeout_is_waited_out_under_mpirun() -> None:
    out = launch([str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                  "tests/mpi/calibrate_wait.py"], timeout=180, env=job_env())
    rows = re.findall(r"^CALIBRATED rank (\d) ([\d.]+) ([\d.]+)$", out, flags=re.M)
    assert sorted(r for r, _, _ in rows) == ["0", "1"], out
    assert all(float(waited) >= 6.0 for _, waited, _ in rows), out  # both waited out rank 0's 3 x 2 s
    assert len({loss for _, _, loss in rows}) == 1, out  # one plan, one loss
