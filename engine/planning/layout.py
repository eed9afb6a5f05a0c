"""Layouts: how the ranks divide into pipeline depth x data-parallel replicas, and the microbatch count.

`engine.plan` takes counts or "auto" for stages, dp and microbatches; this module turns them into the
list of layouts to plan (one when all are given), checking each against the world and the batch.
"""
from __future__ import annotations

from typing import Any

import attrs

from ..errors import PlanError

AUTO = "auto"
MAX_MICROBATCHES_PER_STAGE = 8  # "auto" tries m in [p, 8p]: past that the bubble gain is under 1/8


@attrs.frozen
class Layout:
    """`pipeline_depth` positions per replica, each holding `stages_per_rank` stages; `dp` replicas;
    each replica's share of the batch cut into `microbatches`. `replicas` (empty: one each) is how many
    ranks run each position inside a replica (`engine.planning.replicas`)."""

    pipeline_depth: int
    stages_per_rank: int
    dp: int
    microbatches: int
    replicas: tuple[int, ...] = ()
    replica_order: str = "split"  # how each replica orders its actions (`schedules.replica_rows`)

    @property
    def counts(self) -> tuple[int, ...]:
        """Ranks per pipeline position inside one dp replica."""
        return self.replicas or (1,) * self.pipeline_depth

    @property
    def replicated(self) -> bool:
        """Some position runs on several ranks inside a dp replica (microbatches are routed between them)."""
        return any(c > 1 for c in self.counts)

    @property
    def num_stages(self) -> int:
        return self.pipeline_depth * self.stages_per_rank

    def microbatch_size(self, batch_size: int) -> int:
        return batch_size // (self.dp * self.microbatches)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _is_auto(x: Any) -> bool:
    return isinstance(x, str) and x.lower() == AUTO


def _count(name: str, value: Any) -> int | None:
    if value is None or _is_auto(value):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name} must be a positive int, 'auto' or None; got {value!r}")
    return value


def _depths(world_size: int, v: int, stages: Any, dp: Any) -> list[int]:
    """Pipeline depths p (ranks per replica) allowed by the stage and dp requests."""
    n_stages, n_dp = _count("stages", stages), _count("dp", dp)
    if n_stages is not None and n_stages % v:
        raise PlanError(f"stages={n_stages} does not split into {v} stages per rank; use a multiple of {v}")
    options = divisors(world_size)
    if n_stages is not None:
        options = [p for p in options if p == n_stages // v]
    if n_dp is not None:
        options = [p for p in options if p * n_dp == world_size]
    if not options:
        valid = [p * v for p in divisors(world_size)]
        raise PlanError(f"stages={stages!r}, dp={dp!r} do not fit world_size={world_size}: the ranks per replica "
                        f"(stages / {v} stages per rank) times dp must equal {world_size}; valid stage counts "
                        f"are {valid}")
    if n_stages is None and n_dp is None and not _is_auto(stages) and not _is_auto(dp):
        return [world_size]  # the default: one replica, every rank a pipeline position
    return options


def microbatch_counts(batch_size: int, p: int, dp: int, microbatches: Any) -> list[int]:
    if batch_size % dp:
        return []
    per_replica = batch_size // dp
    m = _count("microbatches", microbatches)
    if m is not None:
        return [m] if per_replica % m == 0 else []
    counts = [c for c in divisors(per_replica) if p <= c <= MAX_MICROBATCHES_PER_STAGE * p]
    return counts or divisors(per_replica)[-1:]


def layouts(world_size: int, batch_size: int, *, v: int, stages: Any, dp: Any, microbatches: Any) -> list[Layout]:
    """Every layout to plan; PlanError naming the valid counts when none fits."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size must be a positive int, got {world_size!r}")
    depths = _depths(world_size, v, stages, dp)
    out = [Layout(p, v, world_size // p, m) for p in depths
           for m in microbatch_counts(batch_size, p, world_size // p, microbatches)]
    if not out:
        valid = "; ".join(f"dp {world_size // p}: {divisors(batch_size // (world_size // p))}"
                          for p in depths if batch_size % (world_size // p) == 0) or "none"
        raise PlanError(f"batch size {batch_size} does not split into dp x microbatches equal parts "
                        f"(microbatches={microbatches!r}, dp={dp!r}, world_size={world_size}); valid microbatch "
                        f"counts: {valid}; pass the full batch, with a size that dp x microbatches divides")
    return out
