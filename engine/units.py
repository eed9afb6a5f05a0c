"""Byte counts as people read them: `512 B`, `3.2 KiB`, `1.5 MiB`, `31.2 GiB`, in the unit that fits."""
from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB")


def nbytes(n: float) -> str:
    """`n` bytes in the largest binary unit that leaves at least 1 of it (one decimal); under 1 KiB, whole
    bytes. Negative counts keep their sign."""
    if n < 0:
        return "-" + nbytes(-n)
    if n < 1024:
        return f"{n:.0f} B"
    value, unit = float(n), "B"
    for unit in _UNITS:
        value /= 1024
        if round(value, 1) < 1024 or unit == _UNITS[-1]:
            break
    return f"{value:.1f} {unit}"
