"""fnpipe's engine: planning, per-rank programs, the runtime, launch, and the public `parallelize`."""
from __future__ import annotations

from .errors import CommTimeoutError, EngineError, PlanError, RuntimeMismatchError, SplitError
from .instructions import CommOp, Instr, Program
from .launch import World, init
from .plan import Plan, StagePlan
from .step import Step, parallelize

__all__ = [
    "CommOp", "CommTimeoutError", "EngineError", "Instr", "Plan", "PlanError", "Program", "RuntimeMismatchError",
    "SplitError", "StagePlan", "Step", "World", "init", "parallelize",
]
