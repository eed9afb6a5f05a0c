"""Progress bars for slow setup work (planning, calibration): tqdm when installed, else one stderr line.

A bar shows only once its work has run for `DELAY` seconds (2 s), so quick plans print nothing; only
rank 0 of a launched job draws one (every rank plans the same plan). `ENGINE_PROGRESS=0` turns them off,
`ENGINE_PROGRESS=1` forces them on every rank. Without tqdm the fallback redraws one line in place on a
terminal (`planning: 3/8 layouts, 4.1 s`) and writes a new line at most every 10 s when stderr is a file.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")
DELAY = 2.0
FILE_INTERVAL = 10.0
TTY_INTERVAL = 0.2
RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def enabled(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether this process draws bars: ENGINE_PROGRESS if set, else only rank 0 (from the launcher's env)."""
    env = os.environ if env is None else env
    flag = env.get("ENGINE_PROGRESS", "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    return all(env.get(k, "0") == "0" for k in RANK_ENV)


class LineBar:
    """The fallback bar: `desc: n/total, elapsed` on stderr, drawn after `delay` seconds, throttled."""

    def __init__(self, total: int | None, desc: str, *, delay: float = DELAY, stream: TextIO | None = None) -> None:
        self.total, self.desc, self.delay = total, desc, delay
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.n, self.start, self.drawn_at, self.drawn_n = 0, time.monotonic(), None, -1
        self.interval = TTY_INTERVAL if self.tty else FILE_INTERVAL

    def text(self) -> str:
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        return f"{self.desc}: {count}, {time.monotonic() - self.start:.1f} s"

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.start < self.delay or (self.drawn_at is not None and now - self.drawn_at < self.interval):
            return
        self.stream.write(("\r" + self.text()) if self.tty else self.text() + "\n")
        self.stream.flush()
        self.drawn_at, self.drawn_n = now, self.n

    def close(self) -> None:
        if self.drawn_at is None:  # never shown: the work was quick
            return
        if self.tty:
            self.stream.write("\r" + self.text() + "\n")
        elif self.drawn_n != self.n:
            self.stream.write(self.text() + "\n")
        self.stream.flush()


def bar(total: int | None, desc: str, *, delay: float = DELAY) -> Any:
    """A bar with `update(n)` and `close()`: tqdm's if importable, else a LineBar; a no-op when disabled."""
    if not enabled():
        return _Null()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return LineBar(total, desc, delay=delay)
    return tqdm(total=total, desc=desc, delay=delay, leave=False, file=sys.stderr)


def track(items: Iterable[T], desc: str, *, total: int | None = None, delay: float = DELAY) -> Iterator[T]:
    """Iterate `items` with a bar (shown only if the loop runs past `delay` seconds)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    b = bar(total, desc, delay=delay)
    try:
        for x in items:
            yield x
            b.update(1)
    finally:
        b.close()


class _Null:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
