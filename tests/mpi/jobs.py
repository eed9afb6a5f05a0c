"""Starting multi-process jobs from pytest: the environment, a free port, and a run that fails with its output."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: mpirun and torchrun sit next to python


def job_env() -> dict[str, str]:
    """What `make test` exports, set here too so that plain pytest works; one thread a rank on shared cores."""
    return dict(os.environ, PYTHONPATH=str(ROOT), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")


def free_port() -> int:
    """A port the OS just handed out (torchrun's `--master-port 0` hangs, so we pick one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run a job to the end and return its output; fail the test with that output unless it exits 0."""
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env or job_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s:\n{exc.stdout or ''}\n{exc.stderr or ''}")
    out = done.stdout + done.stderr
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {done.returncode}:\n{out[-20000:]}")
    return out
