"""Exceptions raised by the IR: bad user functions (TraceError) and malformed graphs (IRError)."""
from __future__ import annotations


class TraceError(ValueError):
    """The user's function cannot be traced into a pure graph; the message names the fix."""


class IRError(ValueError):
    """A graph violates an IR invariant; the message shows the equations around the failure."""
