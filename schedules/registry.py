"""The schedules by name: ``get``, ``names`` and ``register``."""

from __future__ import annotations

import difflib
from typing import Protocol

from schedules.dualpipev import dualpipev
from schedules.errors import ScheduleError
from schedules.gpipe import gpipe
from schedules.interleaved import interleaved_1f1b
from schedules.interleaved_zb import interleaved_zb
from schedules.looped_bfs import looped_bfs
from schedules.one_f_one_b import one_f_one_b
from schedules.table import Table
from schedules.zb_h1 import zb_h1
from schedules.zbv import zbv

__all__ = ["ScheduleFn", "get", "names", "register"]


class ScheduleFn(Protocol):
    """A schedule: ``(num_stages, num_microbatches, **options) -> Table``."""

    def __call__(self, num_stages: int, num_microbatches: int, **options: object) -> Table: ...


_REGISTRY: dict[str, ScheduleFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "looped-bfs": looped_bfs,
    "interleaved-zb": interleaved_zb,
    "zb-h1": zb_h1,
    "zbv": zbv,
    "dualpipev": dualpipev,
}


def names() -> tuple[str, ...]:
    """Registered schedule names, sorted."""
    return tuple(sorted(_REGISTRY))


def get(name: str) -> ScheduleFn:
    """The schedule function called ``name``; an unknown name lists the known ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        pass
    known = names()
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ScheduleError(f"unknown schedule {name!r}; known: {', '.join(known)}{hint}")


def register(name: str, fn: ScheduleFn, *, overwrite: bool = False) -> None:
    """Make ``get(name)`` return ``fn``; replacing a registered name needs ``overwrite=True``."""
    if not isinstance(name, str) or not name:
        raise ScheduleError(f"a schedule name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise ScheduleError(f"schedule {name!r} must be callable "
                            f"(num_stages, num_microbatches, **options) -> Table, got {fn!r}")
    if name in _REGISTRY and not overwrite:
        raise ScheduleError(f"schedule {name!r} is already registered; pass overwrite=True to "
                            "replace it or pick another name")
    _REGISTRY[name] = fn
