"""Timeline: what each rank did when, the value every writer (ASCII, Perfetto, PNG) draws."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from schedules.action import COMPUTE_KINDS
from schedules.errors import ScheduleError
from schedules.simulate import Simulation, as_simulation
from schedules.table import Table

__all__ = ["BAR_KINDS", "COMM", "OTHER", "Bar", "Timeline", "as_timeline"]

COMM = "comm"  # sends and receives
OTHER = "other"  # what is neither compute nor communication: loss, reductions
BAR_KINDS = (*COMPUTE_KINDS, COMM, OTHER)


def _kind(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in BAR_KINDS:
        raise ScheduleError(f"unknown bar kind {value!r}; use one of {', '.join(BAR_KINDS)}")


def _optional_int(value: int | None) -> int | None:
    return None if value is None or value < 0 else int(value)


@attrs.frozen
class Bar:
    """``rank`` ran ``label`` (``1F0``, ``comm SF0``) from ``start`` to ``end``; ``kind`` is F, B,
    W, BW, comm or other. Stage and microbatch are None where the work has none."""

    rank: int
    label: str
    kind: str = attrs.field(validator=_kind)
    start: float
    end: float
    stage: int | None = attrs.field(default=None, converter=_optional_int)
    microbatch: int | None = attrs.field(default=None, converter=_optional_int)

    @property
    def length(self) -> float:
        return max(0.0, self.end - self.start)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


def _ranks_of(instance: Timeline) -> tuple[int, ...]:
    return tuple(sorted({bar.rank for bar in instance.bars}))


@attrs.frozen
class Timeline:
    """Bars of one step, one row per rank in ``ranks``. Times are seconds when ``seconds`` (a
    measured run), else the cost units of a simulation."""

    bars: tuple[Bar, ...] = attrs.field(converter=tuple)
    ranks: tuple[int, ...] = attrs.field(
        converter=tuple, default=attrs.Factory(_ranks_of, takes_self=True))
    seconds: bool = False

    def __attrs_post_init__(self) -> None:
        missing = sorted({bar.rank for bar in self.bars} - set(self.ranks))
        if missing:
            raise ScheduleError(
                f"bars on ranks {missing} that are not in ranks {list(self.ranks)}; "
                "leave ranks out to take every rank that has a bar")

    def __str__(self) -> str:
        return f"{len(self.bars)} bars on {len(self.ranks)} ranks, {self.summary()}"

    def summary(self) -> str:
        """``makespan 12, bubble 33.3%`` (``makespan 4.1 ms, ...`` for a measured run)."""
        return f"makespan {self.format_time(self.makespan)}, bubble {self.bubble_fraction:.1%}"

    def row(self, rank: int, *, compute: bool = False) -> list[Bar]:
        """The bars of ``rank`` in order (only compute bars with ``compute``)."""
        return [b for b in self.bars if b.rank == rank and (b.is_compute or not compute)]

    @property
    def makespan(self) -> float:
        return max([0.0, *(bar.end for bar in self.bars)])

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time not spent in compute, as ``Simulation.bubble_fraction``."""
        total = self.makespan * len(self.ranks)
        busy = sum(sum(b.end - b.start for b in self.row(r, compute=True)) for r in self.ranks)
        return (total - busy) / total if total > 0 else 0.0

    def format_time(self, t: float) -> str:
        """``t`` in milliseconds for a measured run (``12.3 ms``), else in cost units."""
        return f"{t * 1e3:.3g} ms" if self.seconds else f"{t:g}"


def as_timeline(schedule: Table | Simulation | Timeline) -> Timeline:
    """``schedule`` itself when a Timeline, else the bars of its simulation (a table is simulated
    with the default costs): one per action, communication actions as ``comm``."""
    if isinstance(schedule, Timeline):
        return schedule
    sim = as_simulation(schedule)
    return Timeline(_bars(sim), ranks=range(sim.table.num_ranks))


def _bars(sim: Simulation) -> Iterable[Bar]:
    for rank, _, action in sim.table.positions():
        kind = action.kind if action.is_compute else COMM
        yield Bar(rank, str(action), kind, sim.start[action], sim.end[action],
                  action.stage, action.microbatch)
