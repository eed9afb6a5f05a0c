"""Faults and hostile input under mpirun at 2 ranks: every case gives a clear error on every rank or correct
numbers, and every job ends by itself within its timeout plus a few seconds (tests/faults/cases.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.faults.cases import TIMEOUT
from tests.mpi.jobs import BIN, ROOT, free_port, job_env

pytestmark = pytest.mark.mpi
ENDS_WITHIN = TIMEOUT + 25.0  # the peer timeout, then MPI_Abort, mpirun's teardown and interpreter start-up


def _job(which: str, limit: float, launcher: str = "mpirun") -> tuple[int, str, float]:
    if launcher == "mpirun":
        cmd = [str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
               "tests/faults/cases.py", which]
    else:  # torchrun's agent ends the other workers when one exits non-zero
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master-port", str(free_port()),
               "tests/faults/cases.py", which]
    began = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=job_env(), capture_output=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{which}: the job did not end within {limit} s:\n{(exc.stdout or b'').decode(errors='replace')}")
    out = (done.stdout + done.stderr).decode(errors="replace")
    return done.returncode, out, time.perf_counter() - began


@pytest.fixture(scope="module")
def healthy() -> dict[tuple[str, int], str]:
    code, out, _ = _job("healthy", 300)
    assert code == 0, out
    assert out.count("DONE rank") == 2, out
    return {(name, int(r)): rest for name, r, rest in re.findall(r"^CASE (\S+) rank (\d) (.*)$", out, flags=re.M)}


REFUSED = {
    "short-table": r"PlanError in \d+\.\d s: schedule 'short' was asked for 2 stages x 4 microbatches and built a "
                   r"table of 2 stages x 3 microbatches; every stage must run F and its backward for every "
                   r"microbatch \(0\.\.3\) exactly once: fix the schedule's builder",
    **{f"timeout={t}": rf"PlanError in 0\.\d s: timeout must be a positive, finite number of seconds, got {g}; e\.g\. parallelize\(\.\.\., timeout=60\)"
       for t, g in (("0", "0"), ("-1.0", "-1.0"), ("inf", "inf"), ("nan", "nan"), ("60", "'60'"))},
    "corrupt-plan-cache": r"PlanCacheError in \d+\.\d s: cannot read plan cache .*deploy\.json: .*; delete it to re-plan",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_input_is_refused_on_every_rank_before_any_wait(healthy, case: str) -> None:
    for rank in range(2):
        assert re.fullmatch(REFUSED[case], healthy[(case, rank)]), healthy[(case, rank)]


def test_twenty_parallelize_calls_keep_descriptors_and_threads_flat(healthy) -> None:
    for rank in range(2):
        fds0, fds1, th0, th1 = map(int, re.fullmatch(r"fds (\d+) -> (\d+), threads (\d+) -> (\d+)",
                                                     healthy[("20-parallelize", rank)]).groups())
        assert fds1 - fds0 <= 4 and th1 - th0 <= 4, healthy[("20-parallelize", rank)]


def test_fnpipe_listens_on_loopback_only_on_one_host(healthy) -> None:
    for rank in range(2):
        found = re.fullmatch(r"new listeners (\d+), outside loopback \[\]", healthy[("loopback-only", rank)])
        assert found and int(found.group(1)) >= 1, healthy[("loopback-only", rank)]  # the store or gloo's


def test_nothing_from_a_peer_is_unpickled(healthy) -> None:
    for rank in range(2):
        assert re.fullmatch(r"ok, \d+ spans gathered", healthy[("no-unpickling", rank)]), healthy


def test_unused_float_leaves_get_zeros_and_integer_leaves_none(healthy) -> None:
    assert json.loads(healthy[("leaves", 0)]) == {"flag": None, "ids": None, "unused": 0.0}
    assert json.loads(healthy[("leaves", 1)]) == {"flag": None, "ids": None, "unused": None}  # held by rank 0


@pytest.mark.parametrize("how", ["hang", "exit", "raise", "kill"])
def test_a_misbehaving_rank_ends_the_whole_job(how: str) -> None:
    code, out, seconds = _job(how, ENDS_WITHIN + 60)
    assert code != 0, out
    assert seconds < ENDS_WITHIN, f"{how}: the job took {seconds:.1f} s to end\n{out}"
    assert "rank 1 misbehaves" in out, out
    if how in ("hang", "exit"):  # the survivor names the rank it waited for, then takes the job down
        assert re.search(r"CommTimeoutError: rank 0: .* rank 1 died or hangs", out), out
        assert "fnpipe: rank 0 failed (CommTimeoutError); aborting the job so that no rank waits forever" in out, out
    if how == "raise":
        assert "fnpipe: rank 1 failed (ValueError); aborting the job" in out, out


@pytest.mark.parametrize("how", ["hang", "raise"])
def test_under_torchrun_a_misbehaving_rank_ends_the_whole_job_too(how: str) -> None:
    code, out, seconds = _job(how, ENDS_WITHIN + 60, launcher="torchrun")
    assert code != 0, out
    assert seconds < ENDS_WITHIN, f"{how}: the job took {seconds:.1f} s to end\n{out}"
    assert "rank 1 misbehaves" in out and "ChildFailedError" in out, out
    if how == "hang":
        assert re.search(r"CommTimeoutError: rank 0: .* rank 1 died or hangs", out), out
