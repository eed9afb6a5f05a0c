"""Action: printing, parsing and the communication helpers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedules
from schedules import Action, ScheduleError


def test_str_golden() -> None:
    assert str(Action(1, "F", 0)) == "1F0"
    assert str(Action(0, "SEND_B", 3)) == "0SEND_B3"
    assert str(Action(12, "BW", 31)) == "12BW31"
    assert [str(Action(2, kind, 5)) for kind in schedules.KINDS] == [
        "2F5", "2B5", "2W5", "2BW5", "2SEND_F5", "2RECV_F5", "2SEND_B5", "2RECV_B5",
    ]


@given(st.integers(0, 10_000), st.sampled_from(schedules.KINDS), st.integers(0, 10_000))
def test_parse_inverts_str(stage: int, kind: str, microbatch: int) -> None:
    action = Action(stage, kind, microbatch)
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("text", ["", "F0", "0F", "0X1", "-1F0", "0f0", "0 F0", "0SEND0", 7])
def test_parse_rejects_with_the_format(text: object) -> None:
    with pytest.raises(ScheduleError, match="<stage><kind><microbatch>"):
        Action.parse(text)  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [(-1, "F", 0), (0, "F", -2), (0, "FW", 0), (True, "F", 0)])
def test_constructor_rejects_bad_fields(args: tuple[object, str, object]) -> None:
    with pytest.raises(ScheduleError):
        Action(*args)  # type: ignore[arg-type]


def test_kind_constants() -> None:
    assert schedules.COMPUTE_KINDS == ("F", "B", "W", "BW")
    assert schedules.COMM_KINDS == ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
    assert (schedules.F, schedules.BW, schedules.SEND_F, schedules.RECV_B) == (
        "F", "BW", "SEND_F", "RECV_B")


def test_communication_helpers() -> None:
    send_f, recv_b = Action.parse("1SEND_F4"), Action.parse("1RECV_B4")
    assert (send_f.is_comm, send_f.is_send) == (True, True)
    assert (send_f.peer_stage, send_f.boundary) == (2, 1)
    assert send_f.partner() == Action(2, "RECV_F", 4)
    assert Action(2, "RECV_F", 4).partner() == send_f
    assert (recv_b.peer_stage, recv_b.partner()) == (2, Action(2, "SEND_B", 4))
    assert Action(2, "SEND_B", 4).boundary == 1
    forward = Action(1, "F", 4)
    assert (forward.is_comm, forward.is_compute, forward.peer_stage, forward.boundary) == (
        False, True, None, None)
    with pytest.raises(ScheduleError, match="no communication partner"):
        forward.partner()
    with pytest.raises(ScheduleError, match="no communication partner"):
        Action(0, "SEND_B", 0).partner()


def test_actions_are_frozen_and_hashable() -> None:
    action = Action(0, "F", 1)
    assert {action: 1}[Action(0, "F", 1)] == 1
    with pytest.raises(AttributeError):
        action.stage = 2  # type: ignore[misc]
