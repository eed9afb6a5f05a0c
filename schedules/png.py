"""save_png: a timeline picture of a simulated schedule (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from schedules.action import BW, B, F, W
from schedules.simulate import Simulation, as_simulation
from schedules.table import Table

__all__ = ["save_png"]

COLORS = {F: "#4C72B0", B: "#DD8452", W: "#55A868", BW: "#C44E52"}
COMM_COLOR = "#8C8C8C"
_NAMES = {F: "F forward", B: "B input grad", W: "W weight grad", BW: "BW full backward"}


def save_png(schedule: Table | Simulation, path: str | Path, *, title: str | None = None) -> None:
    """Draw one row per rank, a bar per compute action coloured by kind and labelled with its
    microbatch (``stage:microbatch`` on ranks with several stages); time spent in communication
    shows as a thin grey bar under the row. A table is simulated with the default costs first."""
    from matplotlib.figure import Figure  # lazy: the package itself needs no matplotlib
    from matplotlib.patches import Patch

    sim = as_simulation(schedule)
    ranks = sim.table.num_ranks
    most = max(sum(a.is_compute for a in row) for row in sim.table.rows)
    fig = Figure(figsize=(min(40.0, 4.0 + 0.35 * most), 1.2 + 0.5 * ranks))
    ax = fig.add_subplot()
    kinds = _draw(ax, sim)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, max(sim.makespan, 1.0))
    ax.set_xlabel("time")
    heading = f"makespan {sim.makespan:g}, bubble {sim.bubble_fraction:.1%}"
    ax.set_title(f"{title}: {heading}" if title else heading)
    handles = [Patch(color=COLORS[k], label=_NAMES[k]) for k in COLORS if k in kinds]
    handles.append(Patch(color=COMM_COLOR, label="in communication"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _draw(ax: Any, sim: Simulation) -> set[str]:
    """Bars and labels for every action; returns the compute kinds drawn."""
    kinds = set()
    several = [len(sim.table.stages_of(r)) > 1 for r in range(sim.table.num_ranks)]
    for rank, _, action in sim.table.positions():
        start, length = sim.start[action], sim.end[action] - sim.start[action]
        if action.is_comm:
            if length > 0:
                ax.barh(rank + 0.36, length, left=start, height=0.12, color=COMM_COLOR)
            continue
        kinds.add(action.kind)
        ax.barh(rank, length, left=start, height=0.6, color=COLORS[action.kind],
                edgecolor="white", linewidth=0.8)
        label = f"{action.stage}:{action.microbatch}" if several[rank] else str(action.microbatch)
        ax.text(start + length / 2, rank, label, ha="center", va="center", fontsize=7,
                color="white")
    return kinds
