"""fnpipe's engine: planning (engine.planning), per-rank programs and their execution (engine.execution),
training utilities (engine.training), and the public `parallelize` that strings them together.

Read ARCHITECTURE.md at the repository root first: the data flow and where each kind of change goes.
"""
from __future__ import annotations

from . import logs, progress, report  # logs applies ENGINE_LOG_LEVEL*
from .errors import CommTimeoutError, EngineError, InputError, PlanError, RuntimeMismatchError, SplitError
from .execution.footprint import Footprint, footprint
from .execution.launch import World, init
from .execution.program import CommOp, Instr, Program
from .execution.step import Step
from .parallelize import parallelize
from .planning import cache as plancache
from .planning.cache import PlanCacheError
from .planning.plan import Plan, StagePlan
from .planning.recipe import Recipe
from .planning.search import plan
from .training import checkpoint, optim, precision
from .training.checkpoint import CheckpointError
from .training.module import ModuleError, functionalize
from .training.precision import mixed_precision
from . import _compat

_compat.install()

__all__ = [
    "CheckpointError", "CommOp", "CommTimeoutError", "EngineError", "Footprint", "InputError", "Instr", "ModuleError", "Plan", "PlanCacheError",
    "PlanError", "Program", "Recipe", "RuntimeMismatchError", "SplitError", "StagePlan", "Step", "World", "checkpoint",
    "footprint", "functionalize", "init", "logs", "mixed_precision", "optim", "parallelize", "plan", "plancache", "precision",
    "progress", "report",
]
