"""One zoo family per architecture under `mpirun -n 2` (gloo): decoder (GPT-2, Llama), encoder (BERT),
encoder-decoder (T5), vision (ViT, a BN-eval ResNet); keyed dropout across ranks, with dp = 2 too.

One launch runs every case of tests/models/mpi_zoo.py; each case is then a test of its own here, and a
case still refused (tests/models/test_zoo.py's BLOCKED) is a strict xfail with its cause.
"""
from __future__ import annotations

import functools
import re
import sys

import pytest

from tests.models.mpi_zoo import CASES
from tests.models.test_zoo import EMPTY_STAGE, GRAD_MODE, SHIFT_RIGHT
from tests.mpi.jobs import BIN, launch

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
BLOCKED = {"llama-zb-h1": GRAD_MODE, "llama-dropout-zbv": GRAD_MODE, "t5-1f1b": SHIFT_RIGHT, "bert-zbv": EMPTY_STAGE}


@functools.cache
def results() -> dict[tuple[int, str], str]:
    """(rank, case) -> its line, from one `mpirun -n 2` of every family."""
    cmd = [str(BIN / "mpirun"), "-n", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
           "tests/models/mpi_zoo.py", *CASES]
    out = launch(cmd, timeout=500)
    return {(int(r), name): line for line, r, name in re.findall(r"^((?:OK|FAIL) rank (\d) (\S+).*)$", out, re.M)}


def _cases() -> list:
    names = [name for family in CASES.values() for name, _, _ in family]
    return [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=BLOCKED[n])] if n in BLOCKED else [])
            for n in names]


@pytest.mark.parametrize("case", _cases())
def test_family_under_mpirun_equals_func_grad(case: str) -> None:
    lines = [results().get((rank, case), f"no line from rank {rank}") for rank in (0, 1)]
    assert all(line.startswith(f"OK rank {r} {case} ") for r, line in enumerate(lines)), lines
