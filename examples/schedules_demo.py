"""Print, simulate and draw every built-in pipeline schedule for p=4 ranks and m=8 microbatches."""

from __future__ import annotations

import sys
from pathlib import Path

import schedules
from schedules import Costs

RANKS, MICROBATCHES = 4, 8
# Schedules with v stages per rank cut the same model into v times more stages, so each stage
# costs 1/v: every makespan below is in units of one forward through a quarter of the model.
STAGES_PER_RANK = {"interleaved-1f1b": 2, "zbv": 2}


def run(name: str, out: Path) -> tuple[str, ...]:
    """Show one schedule, write its PNG and Perfetto trace, and return its summary row."""
    v = STAGES_PER_RANK.get(name, 1)
    options = {"stages_per_rank": v} if name == "interleaved-1f1b" else {}
    table = schedules.get(name)(RANKS * v, MICROBATCHES, **options)
    lowered = schedules.lower(table)
    schedules.validate(lowered)
    costs = Costs.uniform(1 / v, 1 / v, 1 / v)
    sim = schedules.simulate(lowered, costs)
    assert sim.makespan == schedules.simulate(table, costs).makespan
    print(f"\n== {name}: {RANKS} ranks, {table.num_stages} stages, {MICROBATCHES} microbatches "
          f"({sum(a.is_comm for row in lowered.rows for a in row)} communication actions)")
    print(schedules.render_ascii(schedules.simulate(table)))
    schedules.save_png(sim, out / f"{name}.png", title=name)
    schedules.save_perfetto(sim, out / f"{name}.json", us_per_unit=1000)
    live = ", ".join(f"{n / v:g}" for n in sim.peak_live)
    return (name, f"{sim.makespan:g}", f"{sim.bubble_fraction:.1%}", live)


def main(argv: list[str]) -> None:
    out = Path(argv[1] if len(argv) > 1 else "out")
    out.mkdir(parents=True, exist_ok=True)
    rows = [run(name, out) for name in schedules.names()]
    header = ("schedule", "makespan", "bubble", "peak live per rank (microbatches x model/p)")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print(f"\nPNG timelines and Perfetto traces (ui.perfetto.dev) written to {out}/")


if __name__ == "__main__":
    main(sys.argv)
