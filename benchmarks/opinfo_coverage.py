"""Measure fnpipe on PyTorch's OpInfo database: traced, evaluated and 2-stage gradients against PyTorch.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/opinfo_coverage.py [--every K] [--only NAME ...] [--json OUT]

Every float64 CPU op of `op_db` (every K-th with --every), up to two samples each, through the checks
of tests/ir/opinfo_ops.py; prints the coverage table and, for each op where fnpipe fails a check that
PyTorch passes, the first error. tests/ir/test_opinfo.py runs the same checks in the suite.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ir"))

import torch  # noqa: E402

from opinfo_ops import REFUSED, check_op, float64_ops, gaps, op_name, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = float64_ops()
    if args.only:
        ops = [op for op in ops if op_name(op) in args.only or op.name in args.only]
    ops = ops[:: args.every]
    start, results = time.perf_counter(), []
    for i, op in enumerate(ops):
        results.append(check_op(op))
        r = results[-1]
        print(f"[{i + 1}/{len(ops)}] {r.name}: {r.passed} {r.seconds:.1f}s", file=sys.stderr, flush=True)
    print(table(results))
    print(f"seconds: {time.perf_counter() - start:.0f}")
    missing = gaps(results)
    refused = [g for g in missing if g[0] in REFUSED]
    other = [g for g in missing if g[0] not in REFUSED]
    print(f"\nfnpipe fails where PyTorch passes: {len(other)} ops (+ {len(refused)} design refusals)")
    by = collections.defaultdict(list)
    for name, check, err in other:
        by[err.split(":")[0] + ": " + err.split(":", 1)[-1][:90]].append(f"{name} ({check})")
    for err, names in sorted(by.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(names):3d}  {err}\n       {', '.join(names)}")
    for name, check, err in refused:
        print(f"  refused {name} ({check}): {REFUSED[name]} -- {err[:120]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"name": r.name, "autograd": r.autograd, "passed": r.passed, "errors": r.errors,
                        "seconds": round(r.seconds, 3)} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
