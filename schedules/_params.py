"""Argument checks shared by the schedule functions, so each one raises the same clear errors."""

from __future__ import annotations

from collections.abc import Mapping

from schedules.errors import ScheduleError

__all__ = ["check_counts", "positive_int", "take_options"]


def positive_int(schedule: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{schedule}: {name} must be an int >= 1, got {value!r}")
    return value


def check_counts(schedule: str, num_stages: object, num_microbatches: object) -> None:
    positive_int(schedule, "num_stages", num_stages)
    positive_int(schedule, "num_microbatches", num_microbatches)


def take_options(
    schedule: str, options: Mapping[str, object], defaults: Mapping[str, object]
) -> dict[str, object]:
    """``defaults`` updated with ``options``; an option the schedule does not know is an error."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        known = ", ".join(sorted(defaults)) or "none"
        raise ScheduleError(
            f"{schedule} does not take option(s) {', '.join(unknown)}; its options: {known}"
        )
    return {**defaults, **options}
