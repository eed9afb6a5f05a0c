"""fnpipe's orders against PyTorch's generated ones on fnpipe's simulator: one table per schedule, p, m and costs.

    PYTHONPATH=. python benchmarks/torch_orders.py [--quick]

PyTorch's order comes from `torch.distributed.pipelining._schedule_visualizer.get_schedule_ops` (absent on an
older torch: the script says so and prints fnpipe's column only). Costs are per rank position (F, B, W of the
rank's share of the model), split evenly between the v stages a rank holds; "uneven" makes the first position
1.3x and the last 1.5x; "slow link" adds a transfer of half a forward per boundary. The zero-bubble family
builds its order from these costs with at most the live microbatches PyTorch's order holds on each rank.
p = 2, 4, 8 and m = p, 2p, 4p (about 5 minutes of CPU; `--quick`: p <= 4); the last line counts the cells
where fnpipe's order is faster, tied and slower.
"""
from __future__ import annotations

import argparse
import time
import warnings

from engine.testing.torch_orders import COUNTERPARTS, compare, torch_table

COSTS = {"F=B=W": ((1, 1, 1), 0.0), "F1 B2 W1": ((1, 2, 1), 0.0), "uneven": (None, 0.0), "slow link": ((1, 2, 1), 0.5)}
GRID = tuple((p, k * p) for p in (2, 4, 8) for k in (1, 2, 4))  # m = p, 2p, 4p


def per_position(label: str, p: int) -> tuple[list[float], list[float], list[float], float]:
    ratio, link = COSTS[label]
    if ratio is None:
        f = [1.3 if q == 0 else 1.5 if q == p - 1 else 1.0 for q in range(p)]
        return f, [2 * x for x in f], list(f), link
    return [float(ratio[0])] * p, [float(ratio[1])] * p, [float(ratio[2])] * p, link


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p <= 4 only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if torch_table("zbv", 2, 4) is None:
        print("this torch has no torch.distributed.pipelining._schedule_visualizer: nothing to compare with")
        return
    print(f"{'schedule':17} {'p':>2} {'m':>3} {'costs':10} {'torch':>8} {'fnpipe':>8} {'fnpipe/torch':>12} "
          f"{'ideal':>7} {'fnpipe/ideal':>12} live t/f")
    tally = {"slower": 0, "tie": 0, "faster": 0}
    for name in COUNTERPARTS:
        for p, m in GRID:
            if args.quick and p > 4:
                continue
            for label in COSTS:
                start = time.perf_counter()
                row = compare(name, p, m, label, *per_position(label, p))
                if row is None:
                    continue
                mark = "  SLOWER" if row.fnpipe > row.torch + 1e-9 else ""
                tally["slower" if mark else "faster" if row.fnpipe < row.torch - 1e-9 else "tie"] += 1
                print(f"{name:17} {p:>2} {m:>3} {label:10} {row.torch:8.2f} {row.fnpipe:8.2f} {row.ratio:12.3f} "
                      f"{row.ideal:7.1f} {row.ideal / row.fnpipe:12.3f} {row.torch_live}/{row.fnpipe_live}{mark}"
                      f"  ({time.perf_counter() - start:.1f}s)")
    print(f"fnpipe against torch: {tally['faster']} faster, {tally['tie']} tied, {tally['slower']} slower")


if __name__ == "__main__":
    main()
