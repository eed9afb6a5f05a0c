"""The wait after the stage programs compile has its own bound: a slow compile is not a dead peer."""
from __future__ import annotations

import re
import sys

import pytest

from tests.mpi.jobs import BIN, ROOT, job_env, launch

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


def test_rank_0_calibrating_past_fnpipe_compile_wait_fails_the_others_naming_it() -> None:
    """With FNPIPE_COMPILE_WAIT=2 and rank 0's calibration taking 6 s, rank 1 stops with the wait's own error
    (it names rank 0, the calibration and the variable), not the store's bare timeout."""
    import subprocess

    env = dict(job_env(), FNPIPE_COMPILE_WAIT="2")
    done = subprocess.run([str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
                           "tests/mpi/calibrate_wait.py"], env=env, capture_output=True, text=True, timeout=180,
                          cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert re.search(r"CommTimeoutError: rank 1: waited [\d.]+ s \(limit 2 s\) for rank 0 to finish calibrating "
                     r"the model's ops.*FNPIPE_COMPILE_WAIT", out), out
