"""Clock, power and throttling per GPU and phase, from nvidia-smi's samples (`h200_session.sh fourpower`).

    python benchmarks/power_phases.py smi.csv phases.txt

smi.csv: `nvidia-smi --query-gpu=timestamp,index,utilization.gpu,clocks.sm,power.draw,temperature.gpu,
clocks_throttle_reasons.active --format=csv,noheader -lms 100`; phases.txt: lines "name YYYY/MM/DD HH:MM:SS.mmm",
each phase running to the next line's time. Only busy samples count (utilization >= 90 %): start-up and compile
time leave a GPU idle. Prints, per phase and GPU: busy samples, median and 10th-percentile SM clock, median
power, the largest temperature, and the share of busy samples with each throttle reason set.
"""
from __future__ import annotations

import datetime as dt
import statistics
import sys

REASONS = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power", 0x8: "hw-slowdown", 0x20: "sw-thermal",
           0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display"}
FMT = "%Y/%m/%d %H:%M:%S.%f"


def _number(text: str) -> float:
    return float(text.strip().split()[0])


def samples(path: str) -> list[tuple[dt.datetime, int, float, float, float, float, int]]:
    out = []
    for line in open(path):
        f = [x.strip() for x in line.split(",")]
        if len(f) < 7:
            continue
        try:
            out.append((dt.datetime.strptime(f[0], FMT), int(f[1]), _number(f[2]), _number(f[3]), _number(f[4]),
                        _number(f[5]), int(f[6], 16)))
        except ValueError:
            continue
    return out


def phases(path: str) -> list[tuple[str, dt.datetime, dt.datetime]]:
    marks = [(line.split()[0], dt.datetime.strptime(" ".join(line.split()[1:3]), FMT)) for line in open(path)
             if line.strip()]
    return [(name, start, marks[k + 1][1]) for k, (name, start) in enumerate(marks[:-1])]


def table(rows, spans) -> str:
    lines = [f"{'phase':8} {'gpu':>3} {'busy':>5} {'SM MHz med':>10} {'p10':>5} {'W med':>6} {'max C':>5}  throttled"]
    for name, start, end in spans:
        for gpu in sorted({r[1] for r in rows}):
            busy = [r for r in rows if start <= r[0] < end and r[1] == gpu and r[2] >= 90]
            if not busy:
                continue
            clocks = sorted(r[3] for r in busy)
            share = {why: sum(1 for r in busy if r[6] & bit) / len(busy) for bit, why in REASONS.items()}
            shown = ", ".join(f"{why} {v:.0%}" for why, v in share.items() if v > 0 and why != "idle") or "-"
            lines.append(f"{name:8} {gpu:>3} {len(busy):>5} {statistics.median(clocks):>10.0f} "
                         f"{clocks[len(clocks) // 10]:>5.0f} {statistics.median(r[4] for r in busy):>6.0f} "
                         f"{max(r[5] for r in busy):>5.0f}  {shown}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    print(table(samples(argv[0]), phases(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
