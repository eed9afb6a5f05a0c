"""Reading and writing tables as .txt (one rank per line), .csv (one rank per row) and .json."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path

from schedules.errors import ScheduleError
from schedules.table import Table

__all__ = ["load_table", "save_table"]

_PLACEMENT = "# stage_to_rank:"
_MICROBATCHES = "# num_microbatches:"
_EMPTY_RANK = "-"


def _directive(lines: list[str], prefix: str) -> list[int] | None:
    for line in lines:
        if line.startswith(prefix):
            try:
                return [int(x) for x in line[len(prefix):].split()]
            except ValueError:
                raise ScheduleError(
                    f"bad directive {line!r}; write {prefix} followed by ints"
                ) from None
    return None


def _load_txt(text: str) -> Table:
    lines = [line.strip() for line in text.splitlines()]
    placement = _directive(lines, _PLACEMENT)
    microbatches = _directive(lines, _MICROBATCHES)
    rows = [[] if line == _EMPTY_RANK else line.split()
            for line in lines if line and not line.startswith("#")]
    return Table.from_rows(
        rows, stage_to_rank=placement, num_microbatches=microbatches[0] if microbatches else None
    )


def _save_txt(table: Table) -> str:
    lines = [
        f"{_PLACEMENT} {' '.join(map(str, table.stage_to_rank))}",
        f"{_MICROBATCHES} {table.num_microbatches}",
    ]
    lines += [" ".join(map(str, row)) or _EMPTY_RANK for row in table.rows]
    return "\n".join(lines) + "\n"


def _load_csv(text: str) -> Table:
    rows = [[cell.strip() for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]
    return Table.from_rows(rows)


def _save_csv(table: Table) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([[str(a) for a in row] for row in table.rows])
    return out.getvalue()


_LOADERS: dict[str, Callable[[str], Table]] = {
    ".txt": _load_txt, ".csv": _load_csv, ".json": Table.from_json,
}
_SAVERS: dict[str, Callable[[Table], str]] = {
    ".txt": _save_txt, ".csv": _save_csv, ".json": Table.to_json,
}


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in _LOADERS:
        raise ScheduleError(
            f"cannot tell the table format of {str(path)!r}; name it .txt, .csv or .json"
        )
    return suffix


def load_table(path: str | Path) -> Table:
    """Read a table written by hand or by ``save_table``; the suffix picks the format.

    .txt: one rank per line, actions separated by whitespace, ``-`` for a rank with no actions,
    ``#`` comments, optional ``# stage_to_rank: 0 1 1 0`` and ``# num_microbatches: 8`` lines.
    .csv: one rank per row, one action per cell (the torch.distributed.pipelining layout).
    .json: ``Table.to_json``. Without a stated placement, each stage goes to the rank computing it.
    """
    path = Path(path)
    return _LOADERS[_suffix(path)](path.read_text())


def save_table(table: Table, path: str | Path) -> None:
    """Write ``table`` in the format named by the suffix (.txt, .csv or .json)."""
    path = Path(path)
    path.write_text(_SAVERS[_suffix(path)](table))
