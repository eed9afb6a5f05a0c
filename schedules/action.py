"""Action: one step of a pipeline schedule, (stage, kind, microbatch), printed like ``1F0``."""

from __future__ import annotations

import re

import attrs

from schedules.errors import ScheduleError

__all__ = [
    "B", "BW", "COMM_KINDS", "COMPUTE_KINDS", "F", "KINDS", "RECV_B", "RECV_F", "SEND_B",
    "SEND_F", "W", "Action",
]

F = "F"  # forward of one microbatch through one stage
B = "B"  # backward w.r.t. the stage input (activation grad)
W = "W"  # backward w.r.t. the stage weights
BW = "BW"  # B and W fused into one action
SEND_F = "SEND_F"  # send this stage's output to stage + 1
RECV_F = "RECV_F"  # receive this stage's input from stage - 1
SEND_B = "SEND_B"  # send the grad w.r.t. this stage's input to stage - 1
RECV_B = "RECV_B"  # receive the grad of this stage's output from stage + 1

COMPUTE_KINDS = (F, B, W, BW)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE_KINDS + COMM_KINDS
_KIND_SET = frozenset(KINDS)

PEER_OFFSET = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}  # peer stage - own stage
PARTNER_KIND = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}
_PATTERN = re.compile(r"(\d+)([A-Z_]+)(\d+)")
_FORMAT_HELP = (
    "write <stage><kind><microbatch>, like '1F0' or '0SEND_B3'; kinds: " + ", ".join(KINDS)
)


def _index(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if type(value) is int and value >= 0:  # the usual case, in one test (lower makes many)
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScheduleError(f"Action.{attribute.name} must be an int >= 0, got {value!r}")


def _kind(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if type(value) is str and value in _KIND_SET:
        return
    if value not in KINDS:
        raise ScheduleError(f"unknown action kind {value!r}; use one of {', '.join(KINDS)}")


@attrs.frozen(cache_hash=True)
class Action:
    """``stage`` runs ``kind`` on ``microbatch``; ``str(Action(1, "F", 0)) == "1F0"``."""

    stage: int = attrs.field(validator=_index)
    kind: str = attrs.field(validator=_kind)
    microbatch: int = attrs.field(validator=_index)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Invert ``str``: ``Action.parse("0SEND_B3") == Action(0, "SEND_B", 3)``."""
        match = _PATTERN.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None or match.group(2) not in KINDS:
            raise ScheduleError(f"cannot parse action {text!r}; {_FORMAT_HELP}")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in PEER_OFFSET

    @property
    def is_send(self) -> bool:
        return self.kind in (SEND_F, SEND_B)

    @property
    def peer_stage(self) -> int | None:
        """The stage on the other end of a communication action; None for compute."""
        offset = PEER_OFFSET.get(self.kind)
        return None if offset is None else self.stage + offset

    @property
    def boundary(self) -> int | None:
        """Stage whose output (or its grad) a communication action carries; None for compute."""
        peer = self.peer_stage
        return None if peer is None else min(self.stage, peer)

    def partner(self) -> Action:
        """The matching communication action on the peer stage (``0SEND_F1`` <-> ``1RECV_F1``)."""
        peer = self.peer_stage
        if peer is None or peer < 0:
            raise ScheduleError(f"{self} has no communication partner")
        return Action(peer, PARTNER_KIND[self.kind], self.microbatch)
