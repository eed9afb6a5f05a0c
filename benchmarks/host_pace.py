"""The host's pace over time: is a fresh machine's host slow for its first minutes (benchmarks/NOTES.md)?

    PYTHONPATH=. python benchmarks/host_pace.py --seconds 90 --every 3 [--cuda] [--settle 0.03] [--out pace.csv]

Every `--every` seconds times three fixed pieces of host work, each the median of a few repeats: a pure-Python
loop, PyTorch's dispatcher on tiny CPU tensors (what an fx program's host side is made of), and with `--cuda`
launches of a tiny kernel on the GPU (the host's side of a launch-bound step; synchronised once at the end of
each batch). Prints one line a probe, milliseconds a piece, and writes them to `--out` as CSV. With `--settle X`
it stops early once the last SETTLED probes of every piece lie within X of their median and that median within
X of the fastest probe so far: the host has settled, so a benchmark can start then (h200_session.sh's
HOST_SETTLE). Run beside a benchmark without `--cuda`, it only samples the host (two of the 16 cores' worth at
most, a few % of the time).
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time
from typing import Callable

import torch

SETTLED = 5  # probes in a row that must agree for --settle


def python_loop() -> None:
    total = 0
    for i in range(200_000):
        total += i * i


def dispatcher(x: torch.Tensor = torch.ones(16)) -> None:
    for _ in range(2_000):
        x = torch.add(x, 1.0)


def launches() -> None:
    x = torch.zeros(16, device="cuda")
    for _ in range(2_000):
        x.add_(1.0)
    torch.cuda.synchronize()


def timed(work: Callable[[], None], repeats: int = 3) -> float:
    """Median milliseconds of `repeats` runs of `work`."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def settled(rows: list[list[float]], within: float) -> bool:
    """The last SETTLED probes of every piece within `within` of their median, itself within `within` of the best."""
    if len(rows) < SETTLED:
        return False
    for col in range(1, len(rows[0])):
        last = [r[col] for r in rows[-SETTLED:]]
        mid = statistics.median(last)
        best = min(r[col] for r in rows)
        if max(abs(x - mid) for x in last) > within * mid or mid > (1 + within) * best:
            return False
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=90.0, help="probe at most this long")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between probes' starts")
    ap.add_argument("--cuda", action="store_true", help="also time kernel launches on the GPU")
    ap.add_argument("--settle", type=float, default=None, help="stop once settled to within this fraction")
    ap.add_argument("--out", default=None, help="CSV of every probe")
    a = ap.parse_args(argv)
    pieces = {"python": python_loop, "dispatch": dispatcher, **({"launch": launches} if a.cuda else {})}
    for work in pieces.values():  # imports, first-call caches, the CUDA context: not the host's pace
        work()
    names = ["t_s", *(f"{k}_ms" for k in pieces)]
    print(" ".join(f"{n:>11}" for n in names), flush=True)
    rows: list[list[float]] = []
    start = time.perf_counter()
    while time.perf_counter() - start < a.seconds:
        began = time.perf_counter()
        rows.append([began - start, *(timed(work) for work in pieces.values())])
        print(" ".join(f"{x:11.2f}" for x in rows[-1]), flush=True)
        if a.settle is not None and settled(rows, a.settle):
            print(f"host settled after {time.perf_counter() - start:.0f} s", flush=True)
            break
        time.sleep(max(0.0, a.every - (time.perf_counter() - began)))
    else:
        if a.settle is not None:
            print(f"host not settled in {a.seconds:.0f} s", flush=True)
    if not rows:
        return
    first, last = rows[0], rows[-1]
    print("first / last probe: " + ", ".join(f"{k} {f / l:.2f} x" for k, f, l in zip(pieces, first[1:], last[1:])),
          flush=True)
    if a.out:
        with open(a.out, "w", newline="") as f:
            csv.writer(f).writerows([names, *rows])


if __name__ == "__main__":
    main()
