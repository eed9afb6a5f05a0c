"""tests/ir: the OpInfo coverage table after a run that checked ops (tests/ir/test_opinfo.py)."""
from __future__ import annotations

from typing import Any


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from opinfo_ops import RESULTS, table

    if RESULTS:
        terminalreporter.write_sep("-", "OpInfo coverage (fnpipe against PyTorch)")
        terminalreporter.write_line(table(RESULTS))
