"""One zoo family per architecture under `mpirun -n 2` (gloo): decoder (GPT-2, Llama), encoder (BERT),
encoder-decoder (T5), vision (ViT, a BN-eval ResNet); keyed dropout across ranks, with dp = 2 too.

One launch runs every case of tests/models/mpi_zoo.py; each case is then a test of its own here.
"""
from __future__ import annotations

import functools
import re
import sys

import pytest

from tests.models.mpi_zoo import CASES
from tests.mpi.jobs import BIN, launch

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@functools.cache
def results() -> dict[tuple[int, str], str]:
    """(rank, case) -> its line, from one `mpirun -n 2` of every family."""
    cmd = [str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
           "tests/models/mpi_zoo.py", *CASES]
    out = launch(cmd, timeout=500)
    return {(int(r), name): line for line, r, name in re.findall(r"^((?:OK|FAIL) rank (\d) (\S+).*)$", out, re.M)}


def _cases() -> list:
    names = [name for family in CASES.values() for name, _, _ in family]
    return names


@pytest.mark.parametrize("case", _cases())
def test_family_under_mpirun_equals_func_grad(case: str) -> None:
    lines = [results().get((rank, case), f"no line from rank {rank}") for rank in (0, 1)]
    assert all(line.startswith(f"OK rank {r} {case} ") for r, line in enumerate(lines)), lines
