"""Table: which actions each rank runs, in order, plus where every stage lives."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any

import attrs

from schedules.action import COMM_KINDS, Action
from schedules.errors import ScheduleError
from schedules.grid import format_grid

__all__ = ["Table"]

_FORMAT = "fnpipe.schedules.Table"
_VERSION = 1
_GRID_COLUMNS = 32  # error messages crop wider grids to the steps around the marked cells
_COMM = frozenset(COMM_KINDS)
_KIND = attrgetter("kind")


def _to_ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    return tuple(ranks)


def _to_rows(rows: Iterable[Iterable[Action]]) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(row) for row in rows)


def _rows_repr(rows: tuple[tuple[Action, ...], ...]) -> str:
    return f"<{len(rows)} ranks, {sum(len(row) for row in rows)} actions>"


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"Table.{name} must be an int >= 1, got {value!r}")


@attrs.frozen
class Table:
    """Rank ``r`` runs ``rows[r]`` in order; stage ``s`` lives on rank ``stage_to_rank[s]``."""

    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...] = attrs.field(converter=_to_ranks)
    rows: tuple[tuple[Action, ...], ...] = attrs.field(converter=_to_rows, repr=_rows_repr)

    def __attrs_post_init__(self) -> None:
        _positive("num_stages", self.num_stages)
        _positive("num_microbatches", self.num_microbatches)
        if not self.rows:
            raise ScheduleError("Table.rows is empty; give one row of actions per rank")
        if len(self.stage_to_rank) != self.num_stages:
            raise ScheduleError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries for {self.num_stages} "
                "stages; give one rank per stage"
            )
        for stage, rank in enumerate(self.stage_to_rank):
            valid = isinstance(rank, int) and not isinstance(rank, bool)
            if not valid or not 0 <= rank < self.num_ranks:
                raise ScheduleError(
                    f"stage {stage} is placed on rank {rank!r} but the table has "
                    f"{self.num_ranks} rows (ranks 0..{self.num_ranks - 1})"
                )
        for rank, row in enumerate(self.rows):
            if all(map(isinstance, row, repeat(Action))):  # the usual case, looped in C
                continue
            for step, action in enumerate(row):
                if not isinstance(action, Action):
                    raise ScheduleError(
                        f"rank {rank} step {step} holds {action!r}, not an Action; "
                        "use Table.from_rows to build a table from strings"
                    )

    @property
    def num_ranks(self) -> int:
        return len(self.rows)

    @property
    def is_lowered(self) -> bool:
        """True when the table holds communication actions (the output of ``lower``)."""
        return any(not _COMM.isdisjoint(map(_KIND, row)) for row in self.rows)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ScheduleError(f"stage {stage} is out of range; the table has {self.num_stages}")
        return self.stage_to_rank[stage]

    def positions(self) -> Iterator[tuple[int, int, Action]]:
        """Every (rank, step, action), rank by rank."""
        for rank, row in enumerate(self.rows):
            for step, action in enumerate(row):
                yield rank, step, action

    def __str__(self) -> str:
        return self.to_grid()

    def to_grid(self, marks: Collection[tuple[int, int]] = (), *, crop: bool = False) -> str:
        """Rank x step grid; (rank, step) cells in ``marks`` print as ``[0B1]``."""
        width = max(len(row) for row in self.rows)
        return format_grid(
            [[str(a) for a in row] for row in self.rows],
            header=[str(step) for step in range(width)],
            labels=[f"r{rank}" for rank in range(self.num_ranks)],
            marks=marks,
            max_columns=_GRID_COLUMNS if crop else None,
        )

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Sequence[str | Action] | str],
        *,
        stage_to_rank: Sequence[int] | None = None,
        num_microbatches: int | None = None,
    ) -> Table:
        """Build a table from action strings, one list (or whitespace-separated string) per rank.

        Without ``stage_to_rank`` each stage goes to the first rank that computes it; without
        ``num_microbatches`` the count is one more than the largest microbatch named.
        """
        parsed = [[_as_action(a) for a in (row.split() if isinstance(row, str) else row)]
                  for row in rows]
        actions = [a for row in parsed for a in row]
        if not actions:
            raise ScheduleError("Table.from_rows got no actions; give one list of actions per rank")
        if stage_to_rank is None:
            stage_to_rank = _infer_placement(parsed, 1 + max(a.stage for a in actions))
        if num_microbatches is None:
            num_microbatches = 1 + max(a.microbatch for a in actions)
        return cls(len(stage_to_rank), num_microbatches, tuple(stage_to_rank), parsed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": list(self.stage_to_rank),
            "rows": [[str(a) for a in row] for row in self.rows],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Table:
        if data.get("format") != _FORMAT or data.get("version") != _VERSION:
            raise ScheduleError(
                f"not a schedule table: expected format {_FORMAT!r} version {_VERSION}, got "
                f"{data.get('format')!r} version {data.get('version')!r}; "
                "write it with Table.to_json"
            )
        missing = {"num_stages", "num_microbatches", "stage_to_rank", "rows"} - set(data)
        if missing:
            raise ScheduleError(f"table JSON lacks {', '.join(sorted(missing))}")
        rows = [[Action.parse(a) for a in row] for row in data["rows"]]
        return cls(data["num_stages"], data["num_microbatches"], tuple(data["stage_to_rank"]), rows)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Table:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ScheduleError(f"table JSON does not parse: {error}") from None
        if not isinstance(data, dict):
            raise ScheduleError(f"table JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)


def _as_action(item: str | Action) -> Action:
    return item if isinstance(item, Action) else Action.parse(item)


def _infer_placement(rows: list[list[Action]], num_stages: int) -> tuple[int, ...]:
    first: dict[int, int] = {}
    for compute_only in (True, False):
        for rank, row in enumerate(rows):
            for action in row:
                if action.is_compute or not compute_only:
                    first.setdefault(action.stage, rank)
    return tuple(first.get(stage, stage % len(rows)) for stage in range(num_stages))
