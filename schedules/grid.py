"""Aligned text grids (one line per rank) shared by Table printing, errors and ASCII timelines."""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["format_grid"]

_WINDOW = 10  # columns kept on each side of the marked cells when a grid is cropped


def _cell(text: str, width: int, marked: bool, room: int) -> str:
    """``text`` padded to ``width`` plus ``room`` (2 leaves space for the brackets of a mark)."""
    return (f"[{text}]" if marked else f" {text}").ljust(width + room)


def _columns(total: int, marks: Collection[tuple[int, int]], max_columns: int | None) -> range:
    if max_columns is None or total <= max_columns:
        return range(total)
    steps = [step for _, step in marks] or [0]
    first = max(0, min(steps) - _WINDOW)
    return range(first, min(total, max(max(steps) + _WINDOW + 1, first + max_columns)))


def format_grid(
    cells: Sequence[Sequence[str]],
    *,
    header: Sequence[str],
    labels: Sequence[str],
    marks: Collection[tuple[int, int]] = (),
    max_columns: int | None = None,
) -> str:
    """Lay ``cells[row][column]`` out under ``header``; marked (row, column) cells print as ``[x]``.

    With ``max_columns``, a wide grid is cropped to the columns around the marks.
    """
    total = max([len(header)] + [len(row) for row in cells])
    columns = _columns(total, marks, max_columns)
    texts = [row[c] if c < len(row) else "" for row in cells for c in columns]
    width = max([len(t) for t in texts] + [len(header[c]) for c in columns if c < len(header)], default=0)
    label_width = max((len(label) for label in labels), default=0)
    room = 2 if marks else 1
    crop_left = "… " if columns.start > 0 else ""
    crop_right = " …" if columns.stop < total else ""
    top = [_cell(header[c] if c < len(header) else "", width, False, room) for c in columns]
    lines = [" " * label_width + crop_left + "".join(top).rstrip()]
    for r, row in enumerate(cells):
        body = "".join(
            _cell(row[c] if c < len(row) else "", width, (r, c) in marks, room) for c in columns
        )
        lines.append(f"{labels[r].ljust(label_width)}{crop_left}{body.rstrip()}{crop_right}")
    return "\n".join(lines)
