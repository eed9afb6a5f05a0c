"""Costs: compute time per stage and kind, transfer time per stage boundary, and memory."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from schedules.action import BW, Action, B, F, W
from schedules.errors import ScheduleError

__all__ = ["Costs", "PerIndex"]

PerIndex = float | tuple[float, ...]  # one number for all stages (or ranks), or one each


def _per_index(value: float | Sequence[float]) -> PerIndex:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, Sequence) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value
    ):
        return tuple(float(v) for v in value)
    raise ScheduleError(f"costs take a number or a sequence of numbers, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: PerIndex) -> None:
    for v in value if isinstance(value, tuple) else (value,):
        if not math.isfinite(v) or v < 0:
            raise ScheduleError(f"Costs.{attribute.name} must be finite and >= 0, got {v!r}")


def _latency(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScheduleError(f"Costs.comm_latency must be one number, got {value!r}")
    return float(value)


def _bandwidth(value: float | None) -> float | None:
    if value is not None and (not isinstance(value, int | float) or not value > 0):
        raise ScheduleError(
            f"comm_bandwidth must be > 0 bytes per time unit (or None), got {value!r}"
        )
    return None if value is None else float(value)


def _at(value: PerIndex, index: int) -> float:
    return value[index] if isinstance(value, tuple) else value


@attrs.frozen
class Costs:
    """Times and bytes for ``simulate``; every per-stage field takes one number or one per stage.

    Times are in any one unit (seconds, or 1 = one forward). ``BW`` costs B + W. Transfers
    between ranks take ``comm_latency + activation_bytes[s] / comm_bandwidth`` for stage ``s``'s
    output or its grad (free by default). Memory per rank: ``static_memory[r]``, plus
    ``memory_per_microbatch[s]`` from each F's start until its BW or W ends, plus
    ``memory_b_to_w[s]`` from each B's start until its W ends; with ``memory_after_b`` a microbatch
    holds that much from its B's end until its W ends (what W still reads).

    The host (optional, all 0 by default): ``issue_forward`` / ``issue_backward_input`` /
    ``issue_backward_weight`` are the seconds a rank's host takes to hand each compute to the device
    (a launch-bound program's launches), ``issue_transfer[s]`` what posting one transfer of stage
    ``s``'s output or grad costs it. With any of them set, each rank's host walks its row ahead of its
    device: a compute starts no earlier than the host begins issuing it and ends no earlier than the
    host has issued all of it (``execute``).
    """

    forward: PerIndex = attrs.field(
        default=1.0, converter=_per_index, validator=_non_negative
    )
    backward_input: PerIndex = attrs.field(
        default=1.0, converter=_per_index, validator=_non_negative
    )
    backward_weight: PerIndex = attrs.field(
        default=1.0, converter=_per_index, validator=_non_negative
    )
    comm_latency: float = attrs.field(default=0.0, converter=_latency, validator=_non_negative)
    comm_bandwidth: float | None = attrs.field(default=None, converter=_bandwidth)
    activation_bytes: PerIndex = attrs.field(
        default=0.0, converter=_per_index, validator=_non_negative
    )
    memory_per_microbatch: PerIndex = attrs.field(
        default=0.0, converter=_per_index, validator=_non_negative
    )
    memory_b_to_w: PerIndex = attrs.field(
        default=0.0, converter=_per_index, validator=_non_negative
    )
    static_memory: PerIndex = attrs.field(
        default=0.0, converter=_per_index, validator=_non_negative
    )
    memory_after_b: PerIndex | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else _per_index(v),
        validator=attrs.validators.optional(_non_negative),
    )
    issue_forward: PerIndex = attrs.field(default=0.0, converter=_per_index, validator=_non_negative)
    issue_backward_input: PerIndex = attrs.field(default=0.0, converter=_per_index, validator=_non_negative)
    issue_backward_weight: PerIndex = attrs.field(default=0.0, converter=_per_index, validator=_non_negative)
    issue_transfer: PerIndex = attrs.field(default=0.0, converter=_per_index, validator=_non_negative)

    @classmethod
    def uniform(cls, f: float = 1.0, b: float = 1.0, w: float = 1.0, **others: object) -> Costs:
        """Same F, B and W time on every stage: ``Costs.uniform(1, 2, 1, comm_latency=0.1)``."""
        return cls(forward=f, backward_input=b, backward_weight=w, **others)  # type: ignore[arg-type]

    def compute_time(self, action: Action) -> float:
        return _COMPUTE[action.kind](self, action.stage)

    @property
    def hosted(self) -> bool:
        """Whether the host's own time is modelled (any ``issue_*`` above 0)."""
        return any(v > 0 for name in _ISSUE_FIELDS for v in _values(getattr(self, name)))

    def issue_time(self, action: Action) -> float:
        """Host seconds to hand a compute to the device (B + W for BW), or to post a transfer of
        ``action.stage``'s boundary for a send or receive."""
        if action.is_compute:
            return _ISSUE[action.kind](self, action.stage)
        return _at(self.issue_transfer, action.boundary)  # type: ignore[arg-type]  # a comm's is set

    def transfer_issue(self, boundary: int) -> float:
        """Host seconds to post one transfer of stage ``boundary``'s output (or of the grad of it)."""
        return _at(self.issue_transfer, boundary)

    def transfer_time(self, boundary: int) -> float:
        """Time to move stage ``boundary``'s output (or the grad of it) to the next rank."""
        if self.comm_bandwidth is None:
            return self.comm_latency
        return self.comm_latency + _at(self.activation_bytes, boundary) / self.comm_bandwidth

    def memory_delta(self, action: Action) -> tuple[float, float]:
        """Bytes allocated when ``action`` starts and when it ends (frees are negative)."""
        return _MEMORY[action.kind](self, action.stage)

    def static(self, rank: int) -> float:
        return _at(self.static_memory, rank)

    def check(self, num_stages: int, num_ranks: int) -> None:
        """Raise unless every per-stage field has ``num_stages`` values (static: ``num_ranks``)."""
        for field in attrs.fields(Costs):
            value = getattr(self, field.name)
            if value is None:
                continue
            want = num_ranks if field.name == "static_memory" else num_stages
            if isinstance(value, tuple) and len(value) != want:
                unit = "ranks" if field.name == "static_memory" else "stages"
                raise ScheduleError(
                    f"Costs.{field.name} has {len(value)} values but the table has {want} "
                    f"{unit}; give one number for all or one per {unit[:-1]}"
                )


def _values(value: PerIndex) -> tuple[float, ...]:
    return value if isinstance(value, tuple) else (value,)


_ISSUE_FIELDS = ("issue_forward", "issue_backward_input", "issue_backward_weight", "issue_transfer")


def _backward_both(costs: Costs, stage: int) -> float:
    return _at(costs.backward_input, stage) + _at(costs.backward_weight, stage)


_COMPUTE: dict[str, Callable[[Costs, int], float]] = {
    F: lambda c, s: _at(c.forward, s),
    B: lambda c, s: _at(c.backward_input, s),
    W: lambda c, s: _at(c.backward_weight, s),
    BW: _backward_both,
}

_ISSUE: dict[str, Callable[[Costs, int], float]] = {
    F: lambda c, s: _at(c.issue_forward, s),
    B: lambda c, s: _at(c.issue_backward_input, s),
    W: lambda c, s: _at(c.issue_backward_weight, s),
    BW: lambda c, s: _at(c.issue_backward_input, s) + _at(c.issue_backward_weight, s),
}


def _between_b_and_w(costs: Costs, stage: int) -> float:
    """What a microbatch of ``stage`` holds from its B's end until its W ends."""
    if costs.memory_after_b is None:
        return _at(costs.memory_per_microbatch, stage) + _at(costs.memory_b_to_w, stage)
    return _at(costs.memory_after_b, stage)


def _backward_input_memory(costs: Costs, stage: int) -> tuple[float, float]:
    full = _at(costs.memory_per_microbatch, stage) + _at(costs.memory_b_to_w, stage)
    return _at(costs.memory_b_to_w, stage), _between_b_and_w(costs, stage) - full


_MEMORY: dict[str, Callable[[Costs, int], tuple[float, float]]] = {
    F: lambda c, s: (_at(c.memory_per_microbatch, s), 0.0),
    B: _backward_input_memory,
    W: lambda c, s: (0.0, -_between_b_and_w(c, s)),
    BW: lambda c, s: (0.0, -_at(c.memory_per_microbatch, s)),
}
