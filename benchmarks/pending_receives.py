"""`engine.report.beside_receives` on a traced step saved by `diagnose_p2.py` (its `spans_*.json`), offline.

    python benchmarks/pending_receives.py \
        benchmarks/results/2026-11-26-s13/call1-fourcheck/spans_gpt_auto_zbv.json

The saved spans carry no program, so a receive is matched to its reader by what it carries and its microbatch:
`recvA<mb>` to the rank's next forward of that microbatch on a stage that receives activations (not stage 0),
`recvG<mb>` to its next input-grad pass (or fused backward; stage 0's weight pass, as it has no input-grad pass)
on a stage that receives grads (not the last), each reader taken once, in time order. A receive waits from its
comm span's start until that reader has its data (`Span.ready`). Each compute's ratio is its in-step time over the
start-up time of its program (the file's `profile`, the median where a stage's program was measured with and
without accumulation).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.report import covered_seconds  # noqa: E402

COMPUTES = ("forward", "backward_input", "backward_weight", "backward")  # backward: a fused B and W


def waits(mine: list[dict[str, Any]], last: int) -> list[tuple[float, float]]:
    """(posted, data there) of each receive of one rank's spans (sorted by start)."""
    taken: set[int] = set()
    out = []
    for span in (s for s in mine if s["kind"] == "comm"):
        for part in span["name"][len("comm "):].split(","):
            if not part.startswith("recv"):
                continue
            what, mb = part[4], int(part[5:])
            reader = next((k for k, c in enumerate(mine) if k not in taken and c["mb"] == mb
                           and c["end"] > span["start"] and _reads(c, what, last)), None)
            if reader is not None:
                taken.add(reader)
                there = mine[reader].get("ready") or mine[reader]["start"]
                out.append((span["start"], there))
    return out


def _reads(c: dict[str, Any], what: str, last: int) -> bool:
    if what == "A":
        return c["kind"] == "forward" and c["stage"] != 0
    first_grad = ("backward_weight", "backward") if c["stage"] == 0 else ("backward_input", "backward")
    return c["kind"] in first_grad and c["stage"] != last


def main() -> None:
    saved = json.loads(Path(sys.argv[1]).read_text())
    start_up: dict[tuple[int, str], list[float]] = {}
    for p in saved["profile"]:
        start_up.setdefault((p["stage"], p["kind"]), []).append(p["seconds"])
    spans = saved["spans"]
    last = max(s["stage"] for s in spans)
    header = ("rank", "beside a receive: computes", "median ratio", "beside none: computes", "median ratio")
    print("  ".join(header))
    for r in sorted({s["rank"] for s in spans}):
        mine = sorted((s for s in spans if s["rank"] == r), key=lambda s: s["start"])
        pending = waits(mine, last)
        split: tuple[list[float], list[float]] = ([], [])
        for c in (s for s in mine if s["kind"] in COMPUTES):
            begin = c.get("ready") or c["start"]
            busy = c["end"] - begin
            base = statistics.median(start_up[(c["stage"], c["kind"])])
            split[0 if covered_seconds(pending, begin, c["end"]) >= busy / 2 else 1].append(busy / base)
        cells = [str(r)] + [x for part in split for x in (str(len(part)), _median(part))]
        print("  ".join(cell.rjust(len(h)) for cell, h in zip(cells, header)))


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}" if values else "-"


if __name__ == "__main__":
    main()
