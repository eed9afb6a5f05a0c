"""How long `schedules.simulate` takes on a 64-rank, 256-microbatch table (issue #3: well under 1 s).

    PYTHONPATH=. python benchmarks/simulate_speed.py
"""
from __future__ import annotations

import statistics
import time

import schedules


def main() -> None:
    rows = []
    for name, stages in (("1f1b", 64), ("gpipe", 64), ("zb-h1", 64), ("zbv", 128)):
        table = schedules.get(name)(stages, 256)
        lowered = schedules.lower(table)
        for label, t in (("unlowered", table), ("lowered", lowered)):
            times = []
            for _ in range(3):
                began = time.perf_counter()
                schedules.simulate(t)
                times.append(time.perf_counter() - began)
            actions = sum(len(r) for r in t.rows)
            rows.append((name, label, actions, statistics.median(times)))
    print(f"{'schedule':10} {'table':10} {'actions':>8} {'seconds':>8}")
    for name, label, actions, s in rows:
        print(f"{name:10} {label:10} {actions:>8} {s:>8.3f}")


if __name__ == "__main__":
    main()
