"""Each stage program's kernels in a profiler trace: inside a step against timed in turn at start-up.

A step run with `step.executor.annotate = True` under `torch.profiler` names each compute's range after its
program (`engine.execution.profile.program_label`, e.g. "3W+"); `Step.profile_programs` names each timed run
the same way. From a Chrome trace (`prof.export_chrome_trace`) `ranges` finds each named range's kernels (a
kernel belongs to the range its launch call, runtime or driver API, fell in, matched through the trace's
correlation ids; NCCL's kernels, on their own streams, are left out), their summed time and the range's device
span (the first kernel's start to the last one's end). `compare` sets the programs of one rank's step beside the same
programs timed in turn: the kernels' ratio says whether the kernels themselves ran slower in the step, the
span's ratio beyond it that the device waited between them (gaps inside a program: the host, a stream wait).
`gaps` splits those gaps: the part where the next kernel's launch call had not returned when the one before it
ended (the device waited for the host), and of the rest, the part while an NCCL kernel ran on the device (its
blocks holding SMs the next kernel needed, or a stream wait on a transfer).
"""
from __future__ import annotations

import bisect
import re
import statistics
from collections import defaultdict
from typing import Any, Sequence

import attrs

LABEL = re.compile(r"^\d+(F|B|W|BW)\+?$")
LAUNCHES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel, and cuLaunchKernel from Triton's kernels


@attrs.frozen
class Ranged:
    """One run of a named program: its kernels' summed seconds, its device span and its kernel count; of the gaps
    between its consecutive kernels, the seconds the host made (`host_gap_s`: the next kernel's launch call
    returned after the kernel before it ended) and, of the others, those while an NCCL kernel ran (`nccl_gap_s`)."""

    label: str
    kernels_s: float
    span_s: float
    count: int
    host_gap_s: float = 0.0
    nccl_gap_s: float = 0.0

    @property
    def gap_s(self) -> float:
        """The device's idle time inside the program's span."""
        return max(0.0, self.span_s - self.kernels_s)


def ranges(events: Sequence[dict[str, Any]]) -> list[Ranged]:
    """Each run of a named program in a trace's events, in order (ranges that launched no kernel left out)."""
    named = sorted((e for e in events if e.get("cat") == "user_annotation" and LABEL.match(e.get("name", ""))),
                   key=lambda e: e["ts"])
    launched = {e["args"]["correlation"]: (e["ts"], e.get("tid"), e["ts"] + e.get("dur", 0))  # Triton's: driver calls
                for e in events if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    starts = [e["ts"] for e in named]
    kernels: dict[int, list[dict[str, Any]]] = defaultdict(list)
    nccl = sorted((k["ts"], k["ts"] + k.get("dur", 0)) for k in events
                  if k.get("cat") == "kernel" and "nccl" in k.get("name", "").lower())
    for k in (e for e in events if e.get("cat") == "kernel" and "nccl" not in e.get("name", "").lower()):
        at, tid, _ = launched.get(k.get("args", {}).get("correlation"), (None, None, None))
        i = -1 if at is None else bisect.bisect_right(starts, at) - 1
        if i >= 0 and at <= named[i]["ts"] + named[i].get("dur", 0) and tid == named[i].get("tid"):
            kernels[i].append(k)  # launched inside the range, by its thread
    out = []
    for i, e in enumerate(named):
        ks = sorted(kernels.get(i, ()), key=lambda k: k["ts"])
        if not ks:
            continue
        host, beside = _gaps(ks, launched, nccl)
        out.append(Ranged(e["name"], sum(k.get("dur", 0) for k in ks) / 1e6,
                          (max(k["ts"] + k.get("dur", 0) for k in ks) - ks[0]["ts"]) / 1e6, len(ks),
                          host / 1e6, beside / 1e6))
    return out


def _gaps(ks: Sequence[dict[str, Any]], launched: dict[Any, tuple[float, Any, float]],
          nccl: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Of the gaps between consecutive kernels `ks` (sorted by start), the microseconds the host made (until the
    next kernel's launch call returned) and, of the rest, those overlapping an NCCL kernel (`nccl`, sorted)."""
    host = beside = 0.0
    end = ks[0]["ts"] + ks[0].get("dur", 0)
    for k in ks[1:]:
        if k["ts"] > end:
            returned = launched.get(k.get("args", {}).get("correlation"), (0, None, 0))[2]
            waited_host = min(max(returned - end, 0.0), k["ts"] - end)
            host += waited_host
            beside += _overlap(nccl, end + waited_host, k["ts"])
        end = max(end, k["ts"] + k.get("dur", 0))
    return host, beside


def _overlap(intervals: Sequence[tuple[float, float]], a: float, b: float) -> float:
    """Time in [a, b) covered by `intervals` (sorted by start; they may overlap one another)."""
    covered, reach = 0.0, a
    for s, e in intervals[:bisect.bisect_left(intervals, (b, b))]:
        lo, hi = max(s, reach), min(e, b)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered


def compare(in_step: Sequence[Ranged], in_turn: Sequence[Ranged]) -> str:
    """Per program of the step (its label), the median run in the step beside the median run in turn: kernel
    milliseconds, span milliseconds and their ratios; the last line sums the step's runs of the programs timed
    in turn, each program's in-turn median once per run in the step."""
    step, turn = _by_label(in_step), _by_label(in_turn)
    header = ("program", "runs", "kernels ms in turn", "in step", "ratio", "span ms in turn", "in step", "ratio")
    rows, sums, runs = [], [0.0, 0.0, 0.0, 0.0], 0
    for label in sorted(step, key=_order):
        mine, base = step[label], turn.get(label)
        k_step, s_step = _median(mine, "kernels_s"), _median(mine, "span_s")
        if base is None:
            rows.append((label, str(len(mine)), "-", _ms(k_step), "-", "-", _ms(s_step), "-"))
            continue
        k_turn, s_turn = _median(base, "kernels_s"), _median(base, "span_s")
        rows.append((label, str(len(mine)), _ms(k_turn), _ms(k_step), f"{k_step / k_turn:.3f}", _ms(s_turn),
                     _ms(s_step), f"{s_step / s_turn:.3f}"))
        runs += len(mine)
        sums[0] += k_turn * len(mine)
        sums[1] += sum(r.kernels_s for r in mine)
        sums[2] += s_turn * len(mine)
        sums[3] += sum(r.span_s for r in mine)
    if sums[0] > 0 and sums[2] > 0:
        rows.append(("all", str(runs), _ms(sums[0]), _ms(sums[1]),
                     f"{sums[1] / sums[0]:.3f}", _ms(sums[2]), _ms(sums[3]), f"{sums[3] / sums[2]:.3f}"))
    return "\n".join(["  ".join(header)] + ["  ".join(c.rjust(len(h)) for c, h in zip(r, header)) for r in rows])


def gaps(in_step: Sequence[Ranged], in_turn: Sequence[Ranged]) -> str:
    """Per program of the step, the median run's idle time inside its span in turn and in the step, and of the
    step's, what the host made and what passed beside an NCCL kernel (milliseconds); the last line sums the
    step's runs (each program's in-turn median once per run in the step)."""
    step, turn = _by_label(in_step), _by_label(in_turn)
    header = ("program", "runs", "gap ms in turn", "in step", "host-made", "beside NCCL", "other")
    rows, sums = [], [0.0, 0.0, 0.0, 0.0]
    for label in sorted(step, key=_order):
        mine, base = step[label], turn.get(label)
        gap, host, beside = (_median(mine, f) for f in ("gap_s", "host_gap_s", "nccl_gap_s"))
        rows.append((label, str(len(mine)), "-" if base is None else _ms(_median(base, "gap_s")), _ms(gap),
                     _ms(host), _ms(beside), _ms(max(0.0, gap - host - beside))))
        if base is not None:
            sums[0] += _median(base, "gap_s") * len(mine)
        sums[1] += sum(r.gap_s for r in mine)
        sums[2] += sum(r.host_gap_s for r in mine)
        sums[3] += sum(r.nccl_gap_s for r in mine)
    rows.append(("all", str(sum(len(v) for v in step.values())), *(_ms(x) for x in sums),
                 _ms(max(0.0, sums[1] - sums[2] - sums[3]))))
    return "\n".join(["  ".join(header)] + ["  ".join(c.rjust(len(h)) for c, h in zip(r, header)) for r in rows])


def _by_label(runs: Sequence[Ranged]) -> dict[str, list[Ranged]]:
    out: dict[str, list[Ranged]] = defaultdict(list)
    for r in runs:
        out[r.label].append(r)
    return out


def _median(runs: Sequence[Ranged], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _order(label: str) -> tuple[int, str]:
    stage = re.match(r"\d+", label)
    return int(stage.group()) if stage else -1, label
