"""PyTorch's generated pipeline orders as fnpipe tables, simulated beside fnpipe's own for the same costs."""
from __future__ import annotations

from typing import Any, Sequence

import attrs

import schedules
from schedules import Action, Costs, Table

__all__ = ["COUNTERPARTS", "ZERO_BUBBLE", "Row", "compare", "torch_rows", "torch_table", "zero_bubble"]

# fnpipe schedule -> PyTorch's schedule class name, stages per rank (the zero-bubble family is built from costs)
COUNTERPARTS: dict[str, tuple[str, int]] = {
    "gpipe": ("GPipe", 1), "1f1b": ("1F1B", 1), "interleaved-1f1b": ("Interleaved1F1B", 2),
    "looped-bfs": ("LoopedBFS", 2), "interleaved-zb": ("InterleavedZeroBubble", 2), "zbv": ("ZBVZeroBubble", 2),
    "dualpipev": ("DualPipeV", 2),
}
ZERO_BUBBLE = ("zb-h1", "zbv", "interleaved-zb", "dualpipev")
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
# torch's computation types by name (their values changed across releases; FULL_BACKWARD is fnpipe's BW)
_KIND = {"FORWARD": schedules.F, "BACKWARD_INPUT": schedules.B, "BACKWARD_WEIGHT": schedules.W,
         "FULL_BACKWARD": schedules.BW}


def zero_bubble(name: str) -> bool:
    return name in ZERO_BUBBLE


def _get_schedule_ops() -> Any:
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError:  # an older torch: no visualizer, nothing to compare with
        return None
    return get_schedule_ops


def torch_rows(name: str, p: int, m: int, v: int) -> list[list[Action]] | None:
    """The compute actions of PyTorch's order for fnpipe's schedule `name` (v stages per rank) on p ranks and m
    microbatches, rank by rank (overlapped F+B actions become their two sub-actions, in order); None where this
    torch lacks the schedule or refuses (p, m)."""
    get_ops = _get_schedule_ops()
    if get_ops is None or name not in COUNTERPARTS:
        return None
    try:
        ops = get_ops(COUNTERPARTS[name][0], p, m, num_stages_per_rank=v)
    except Exception:  # noqa: BLE001 - torch refuses this (p, m) (its own ValueError/AssertionError)
        return None
    return [[Action(x.stage_index, _KIND[_kind(x)], x.microbatch_index)
             for a in ops[r] if a is not None for x in (a.sub_actions or (a,)) if _kind(x) in _KIND]
            for r in range(p)]  # compute only: torch's REDUCE_GRAD and the like take no time here


def torch_table(name: str, p: int, m: int) -> Table | None:
    """PyTorch's order for fnpipe's schedule `name` on p ranks and m microbatches as a Table (`torch_rows` with the
    stages per rank of COUNTERPARTS); None where this torch lacks the schedule or refuses (p, m)."""
    if name not in COUNTERPARTS:
        return None
    torch_name, v = COUNTERPARTS[name]
    rows = torch_rows(name, p, m, v)
    if rows is None:
        return None
    n = p * v
    placement = [(s if s < p else n - 1 - s) if torch_name in _V_SHAPED else s % p for s in range(n)]
    try:  # torch 2.13's visualizer shifts the microbatches of 1F1B's later ranks (its mock stage is rank 0)
        table = Table(n, m, placement, rows)
        schedules.validate(table)
    except schedules.ScheduleError:
        return None
    return table


def _kind(action: Any) -> str:
    kind = action.computation_type
    return str(getattr(kind, "name", kind))


@attrs.frozen
class Row:
    """One comparison: a schedule's makespan from PyTorch's order and from fnpipe's, with each one's peak live."""

    schedule: str
    p: int
    m: int
    costs: str
    torch: float
    fnpipe: float
    ideal: float
    torch_live: int
    fnpipe_live: int

    @property
    def ratio(self) -> float:
        return self.fnpipe / self.torch


def stage_costs(n: int, v: int, f: Sequence[float], b: Sequence[float], w: Sequence[float], link: float) -> Costs:
    """Per-stage costs where a rank holding v stages runs each in 1/v of the rank's share (`f` etc. are per rank
    position, the model's cost split evenly into its p positions, then into v stages per position)."""
    p = n // v
    pos = [s % p for s in range(n)]
    return Costs(forward=[f[q] / v for q in pos], backward_input=[b[q] / v for q in pos],
                 backward_weight=[w[q] / v for q in pos], comm_latency=link)


def fnpipe_table(name: str, n: int, m: int, costs: Costs, max_live: Sequence[int] | None) -> Table:
    options: dict[str, Any] = {}
    v = COUNTERPARTS.get(name, ("", 1))[1]
    if name in ("interleaved-1f1b", "looped-bfs", "interleaved-zb"):
        options["stages_per_rank"] = v
    if zero_bubble(name):
        options["costs"] = costs
        options["max_live"] = tuple(max_live) if max_live is not None else None
    return schedules.get(name)(n, m, **options)


def compare(name: str, p: int, m: int, label: str, f: Sequence[float], b: Sequence[float], w: Sequence[float],
            link: float = 0.0) -> Row | None:
    """Simulate PyTorch's order and fnpipe's for `name` under the same costs and (zero-bubble family) memory:
    fnpipe's order may hold at most what PyTorch's holds on each rank. None where torch has no such order."""
    theirs = torch_table(name, p, m)
    if theirs is None:
        return None
    n = theirs.num_stages
    costs = stage_costs(n, n // p, f, b, w, link)
    them = schedules.simulate(theirs, costs)
    mine = schedules.simulate(fnpipe_table(name, n, m, costs, them.peak_live), costs)
    ideal = max(mine.busy)
    return Row(name, p, m, label, them.makespan, mine.makespan, ideal, max(them.peak_live), max(mine.peak_live))
