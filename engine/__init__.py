"""fnpipe's engine: planning, per-rank programs, the runtime, launch, and the public `parallelize`."""
from __future__ import annotations

from . import checkpoint, logs, optim, plancache, precision, progress, report  # logs applies ENGINE_LOG_LEVEL*
from .checkpoint import CheckpointError
from .errors import CommTimeoutError, EngineError, PlanError, RuntimeMismatchError, SplitError
from .footprint import Footprint, footprint
from .instructions import CommOp, Instr, Program
from .launch import World, init
from .module import ModuleError, functionalize
from .plan import Plan, StagePlan
from .planner import plan
from .precision import mixed_precision
from .plancache import PlanCacheError
from .step import Step, parallelize

__all__ = [
    "CheckpointError", "CommOp", "CommTimeoutError", "EngineError", "Footprint", "Instr", "ModuleError", "Plan", "PlanCacheError",
    "PlanError", "Program", "RuntimeMismatchError", "SplitError", "StagePlan", "Step", "World", "checkpoint",
    "footprint", "functionalize", "init", "logs", "mixed_precision", "optim", "parallelize", "plan", "plancache", "precision",
    "progress", "report",
]
