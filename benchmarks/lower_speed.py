"""How long `schedules.lower` and `schedules.validate` take as the pipeline grows (lowering used to
run the whole table again for every receiver that had to wait; both are now about linear).

    PYTHONPATH=. python benchmarks/lower_speed.py

Target: interleaved-1f1b at 64 ranks x 4 stages per rank (256 stages, 128 microbatches) lowers
and validates in under 1 s together; 1f1b at 64 ranks well under. Seconds are medians of three
runs: wall clock, and this process's CPU time (steadier on a shared machine).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import schedules


def _median_seconds(run: Callable[[], object], repeats: int = 3) -> tuple[float, float]:
    wall, cpu = [], []
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    print(f"{'schedule':17} {'ranks':>5} {'stages':>6} {'mb':>4} {'actions':>8} "
          f"{'lower s':>8} {'validate s':>10} {'lower cpu':>9} {'validate cpu':>12}")
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 4)):
        for ranks in (8, 16, 32, 64):
            options = {"stages_per_rank": v} if name == "interleaved-1f1b" else {}
            table = schedules.get(name)(v * ranks, 2 * ranks, **options)
            lowered = schedules.lower(table)
            lower_s, lower_cpu = _median_seconds(lambda t=table: schedules.lower(t))
            validate_s, validate_cpu = _median_seconds(lambda t=lowered: schedules.validate(t))
            actions = sum(len(row) for row in lowered.rows)
            print(f"{name:17} {ranks:>5} {table.num_stages:>6} {table.num_microbatches:>4} "
                  f"{actions:>8} {lower_s:>8.3f} {validate_s:>10.3f} {lower_cpu:>9.3f} "
                  f"{validate_cpu:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
