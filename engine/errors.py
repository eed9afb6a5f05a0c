"""Exceptions of the engine: each names the numbers and the fix."""
from __future__ import annotations

from typing import Any

from ir.errors import TraceError
from ir.trace_errors import not_a_function


class EngineError(ValueError):
    """Base class of the engine's user-facing errors."""


class SplitError(EngineError):
    """No split of the model fits the devices; the message says what would."""


class PlanError(EngineError):
    """The requested stages / replicas / microbatches / schedule do not fit the world or the batch."""


class InputError(PlanError):
    """The params or batch given to a step (or to `step.shard`) do not match what was planned, or the ranks
    passed different values where they must pass equal ones."""


class RuntimeMismatchError(EngineError):
    """Ranks hold different plans or programs, or a peer failed; the step refuses to run."""


class CommTimeoutError(EngineError):
    """A collective or point-to-point wait exceeded its timeout (a peer died or hung)."""


class CheckpointError(EngineError):
    """A checkpoint is incomplete, damaged or hostile, or does not match the tree or plan it is loaded into."""


class ModuleError(EngineError, TraceError):
    """The module cannot be a pure function as it stands (it mutates buffers or draws random numbers),
    or a module was given where a pure function is expected."""


def require_function(fn: Any, entry: str) -> None:
    """Refuse an `nn.Module` where a pure loss function is expected, pointing at engine.functionalize."""
    problem = not_a_function(fn, entry)
    if problem:
        raise ModuleError(problem)
