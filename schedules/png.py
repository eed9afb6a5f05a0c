"""save_png: a timeline picture of a schedule or a measured run (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schedules.action import BW, B, F, W
from schedules.simulate import Simulation
from schedules.table import Table
from schedules.timeline import BAR_KINDS, COMM, OTHER, Bar, Timeline, as_timeline

__all__ = ["save_png"]

COLORS = {F: "#4C72B0", B: "#DD8452", W: "#55A868", BW: "#C44E52", COMM: "#8C8C8C",
          OTHER: "#C8C8C8"}
_NAMES = {F: "F forward", B: "B input grad", W: "W weight grad", BW: "BW full backward",
          COMM: "communication", OTHER: "loss / reductions"}
_LABELLED = 1 / 80  # bars shorter than this share of the makespan carry no label


def save_png(schedule: Table | Simulation | Timeline, path: str | Path, *,
             title: str | None = None) -> None:
    """Draw one row per rank, a bar per compute action coloured by kind and labelled with its
    microbatch (``stage:microbatch`` on ranks with several stages); communication shows as a thin
    grey bar under the row, other work (loss, reductions) as a low light-grey bar. A table is
    simulated with the default costs first; a measured run's time axis is in milliseconds."""
    from matplotlib.figure import Figure  # lazy: the package itself needs no matplotlib
    from matplotlib.patches import Patch

    timeline = as_timeline(schedule)
    ranks = len(timeline.ranks)
    most = max([1, *(len(timeline.row(r, compute=True)) for r in timeline.ranks)])
    fig = Figure(figsize=(min(40.0, 4.0 + 0.35 * most), 1.2 + 0.5 * ranks))
    ax = fig.add_subplot()
    kinds = _draw(ax, timeline)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in timeline.ranks])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, timeline.makespan * _scale(timeline) or 1.0)
    ax.set_xlabel("ms from the step's start" if timeline.seconds else "time")
    heading = timeline.summary()
    ax.set_title(f"{title}: {heading}" if title else heading)
    handles = [Patch(color=COLORS[k], label=_NAMES[k]) for k in BAR_KINDS if k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _scale(timeline: Timeline) -> float:
    return 1e3 if timeline.seconds else 1.0


def _draw(ax: Any, timeline: Timeline) -> set[str]:
    """Bars and labels for every bar of positive length; returns the kinds drawn."""
    kinds = set()
    scale = _scale(timeline)
    y = {rank: k for k, rank in enumerate(timeline.ranks)}
    several = {r: len({b.stage for b in timeline.row(r, compute=True)}) > 1 for r in y}
    for bar in timeline.bars:
        if bar.length <= 0:
            continue
        kinds.add(bar.kind)
        left, length = bar.start * scale, bar.length * scale
        if bar.kind == COMM:
            ax.barh(y[bar.rank] + 0.36, length, left=left, height=0.12, color=COLORS[COMM])
        elif bar.kind == OTHER:
            ax.barh(y[bar.rank], length, left=left, height=0.3, color=COLORS[OTHER])
        else:
            ax.barh(y[bar.rank], length, left=left, height=0.6, color=COLORS[bar.kind],
                    edgecolor="white", linewidth=0.8)
            if bar.length > timeline.makespan * _LABELLED:
                ax.text(left + length / 2, y[bar.rank], _label(bar, several[bar.rank]),
                        ha="center", va="center", fontsize=7, color="white")
    return kinds


def _label(bar: Bar, several_stages: bool) -> str:
    if bar.microbatch is None:
        return bar.label
    return f"{bar.stage}:{bar.microbatch}" if several_stages else str(bar.microbatch)
