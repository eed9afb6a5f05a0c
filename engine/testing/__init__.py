"""fnpipe's test harness: random models, a one-process pipeline reference, and equivalence checks."""
from __future__ import annotations

from .chain import chain_value_and_grad
from .compare import max_relative_error
from .models import LAYER_KINDS, Layer, ModelCase, ModelSpec, build, models

__all__ = [
    "LAYER_KINDS", "Layer", "ModelCase", "ModelSpec", "build", "chain_value_and_grad", "max_relative_error",
    "models",
]

# The equivalence harness (plans, assert_parallel_equivalent, faults); see engine/testing/harness.py.
from . import faults  # noqa: E402
from .harness import STATS, Equivalence, assert_parallel_equivalent, format_stats, in_distributed_job  # noqa: E402
from .mismatch import RTOL, ParallelDeadlock, ParallelMismatch  # noqa: E402
from .plans import PlanSpec, models_and_plans, plans  # noqa: E402

__all__ += [
    "Equivalence", "ParallelDeadlock", "ParallelMismatch", "PlanSpec", "RTOL", "STATS", "assert_parallel_equivalent",
    "faults", "format_stats", "in_distributed_job", "models_and_plans", "plans",
]
