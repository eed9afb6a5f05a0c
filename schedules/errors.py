"""ScheduleError: the one exception the schedules package raises for user mistakes."""

from __future__ import annotations

__all__ = ["ScheduleError"]


class ScheduleError(ValueError):
    """An invalid schedule, table, parameter or cost; the message gives the numbers and the fix."""
