"""A rank that dies or hangs mid-step: every other rank exits non-zero, soon, naming what it waited for.

The ranks are started here with torch.distributed's env (not by mpirun, which would kill the survivors
itself) and run tests/mpi/die.py, which trains in a loop and can stall one rank halfway through a step.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpi.jobs import ROOT, free_port, job_env

pytestmark = pytest.mark.mpi
DEADLINE_S = 60.0  # the acceptance bound: survivors are gone this long after the failure
TIMEOUT_S = 10.0   # parallelize(timeout=...) in the script
# what a survivor's last words must say: its rank, what it waited on, and who to blame
SURVIVOR = re.compile(r"CommTimeoutError: rank (\d+): (.+?) failed after [\d.]+ s \(timeout 10 s\): "
                      r"(?:rank (\d+)|one of ranks \[[\d, ]+\]) died or hangs; check (?:its log|their logs)")


class Job:
    """`ranks` processes of tests/mpi/die.py, their output in files (a full pipe would block a rank)."""

    def __init__(self, tmp: Path, ranks: int, *args: str) -> None:
        port, self.tmp = free_port(), tmp
        self.procs = []
        for r in range(ranks):
            env = dict(job_env(), RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            with open(tmp / f"out{r}", "w") as out, open(tmp / f"err{r}", "w") as err:
                self.procs.append(subprocess.Popen([sys.executable, "tests/mpi/die.py", *args], cwd=ROOT, env=env,
                                                   stdout=out, stderr=err))

    def out(self, r: int) -> str:
        return (self.tmp / f"out{r}").read_text()

    def err(self, r: int) -> str:
        return (self.tmp / f"err{r}").read_text()

    def wait_for(self, r: int, text: str, within: float = 180.0) -> None:
        end = time.monotonic() + within
        while text not in self.out(r):
            if time.monotonic() > end or any(p.poll() is not None for p in self.procs):
                pytest.fail(f"rank {r} never printed {text!r}:\n{self.report()}")
            time.sleep(0.05)

    def exits(self, ranks: list[int], since: float) -> dict[int, tuple[int, float]]:
        """Each rank's exit code and seconds from `since` to its exit; fails if one outlives the deadline."""
        done = {}
        while len(done) < len(ranks):
            for r in ranks:
                if r not in done and self.procs[r].poll() is not None:
                    done[r] = (self.procs[r].returncode, time.monotonic() - since)
            if time.monotonic() - since > DEADLINE_S:
                pytest.fail(f"ranks {sorted(set(ranks) - set(done))} still running {DEADLINE_S} s after the "
                            f"failure:\n{self.report()}")
            time.sleep(0.05)
        return done

    def report(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}):\n{self.out(r)[-2000:]}\n{self.err(r)[-3000:]}"
                         for r, p in enumerate(self.procs))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def job(tmp_path: Path):
    made: list[Job] = []
    yield lambda *a: made.append(Job(tmp_path, *a)) or made[-1]
    for j in made:
        j.close()


def assert_survivors_failed(job: Job, exits: dict[int, tuple[int, float]], blame: int) -> list[str]:
    """Every survivor exited non-zero with a CommTimeoutError naming itself; one names `blame`."""
    named = []
    for r, (code, secs) in sorted(exits.items()):
        assert code != 0, f"rank {r} exited 0 after the failure:\n{job.report()}"
        found = SURVIVOR.search(job.err(r))
        assert found and int(found.group(1)) == r, f"rank {r} did not name the failure:\n{job.err(r)[-3000:]}"
        named.append(found.group(3))
    assert str(blame) in named, f"no survivor named rank {blame}: {named}\n{job.report()}"
    return [job.err(r) for r in exits]


@pytest.mark.parametrize("ranks,schedule,stages,dp,victim", [
    (2, "1f1b", 2, 1, 1),
    (4, "1f1b", 2, 2, 1),   # survivors fail in P2P, the grad sums over replicas and the loss sum
], ids=["2 ranks", "2 stages x dp 2"])
def test_killed_rank_makes_the_others_exit_with_a_clear_error(job, ranks, schedule, stages, dp, victim) -> None:
    j = job(ranks, schedule, str(stages), str(dp), str(TIMEOUT_S), f"{victim}:2")
    j.wait_for(victim, f"rank {victim} stalled in step 2")
    assert f"rank {victim} step 1 loss" in j.out(victim)
    killed = time.monotonic()
    os.kill(j.procs[victim].pid, signal.SIGKILL)
    exits = j.exits([r for r in range(ranks) if r != victim], killed)
    assert_survivors_failed(j, exits, victim)
    # a dead peer closes its sockets: the survivors notice that, not the end of their timeout
    assert max(secs for _, secs in exits.values()) < TIMEOUT_S, exits


def test_hung_rank_makes_the_others_time_out(job) -> None:
    j = job(2, "gpipe", "2", "1", str(TIMEOUT_S), "0:1")
    j.wait_for(0, "rank 0 stalled in step 1")
    stalled = time.monotonic()
    (code, secs), = j.exits([1], stalled).values()
    assert_survivors_failed(j, {1: (code, secs)}, 0)
    assert "timed out" in j.err(1).lower(), j.err(1)
    assert TIMEOUT_S * 0.8 <= secs <= TIMEOUT_S + 20, secs  # it waited its timeout, not much more


def test_timeout_bounds_the_fingerprint_all_gather(job) -> None:
    """The default process group is made with a 10-minute timeout; parallelize's 10 s must still win."""
    j = job(2, "1f1b", "2", "1", str(TIMEOUT_S), "1:verify")
    j.wait_for(1, "rank 1 stalled before verify")
    stalled = time.monotonic()
    (code, secs), = j.exits([0], stalled).values()
    assert_survivors_failed(j, {0: (code, secs)}, 1)
    assert "all-gather over all ranks" in j.err(0), j.err(0)
    assert secs <= TIMEOUT_S + 20, secs
