"""Running one callable per rank at once, in threads (ranks of an in-process hub), for the engine tests."""
from __future__ import annotations

import threading
from typing import Any, Callable


def on_threads(n: int, work: Callable[[int], Any], *, timeout: float = 60.0) -> list[Any]:
    """`work(r)` for r in range(n), all at once: each result, or the exception it raised; fails if one hangs."""
    out: list[Any] = [None] * n

    def run(r: int) -> None:
        try:
            out[r] = work(r)
        except BaseException as exc:  # noqa: BLE001 -- returned to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out
