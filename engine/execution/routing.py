"""Routing: which world rank runs which pipeline position and microbatches, with replicas per stage.

A plan's world is `dp` pipeline replicas of `sum(plan.replicas)` ranks each. Inside one, pipeline
position q runs on `plan.replicas[q]` consecutive ranks, and replica k of q runs microbatch i when
`i % replicas[q] == k` (`schedules.Replicas`): so

    world rank = d * sum(replicas) + sum(replicas[:q]) + k          (dp replica d, position q, replica k)

With one replica everywhere this is today's `d * p + q`, and nothing below changes what such a plan runs.
The table stays the schedule of the p positions over all microbatches of a dp replica. With unequal
counts a rank runs the compute actions of its microbatches in the order the plan names
(`schedules.replica_rows`: its position's row filtered, or the schedule of its own share), and
`schedules.lower_replicated` adds the transfers: each to the rank of the peer position that owns that
microbatch (`world_rank`), receives in send order on every pair of ranks. With equal counts nothing of
this runs: a rank runs its position's row of the lowered table, as before. Channels and grad groups are
read off the same routing, so every rank derives them alike without another's program.

Loss and grads stay those of one process: every microbatch runs once, on exactly one rank of each
position; the loss seed and each added loss are 1/(microbatches x dp) of a microbatch's (or its weight, for
a loss averaged over counted targets: `loss_weights`, read by microbatch index, so routing leaves it alone), and each stage's weight grads are summed over all the ranks that hold the stage, its
replicas in every dp replica (a tied leaf: over every rank of every stage that reads it).
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Sequence

import attrs

import schedules

from ..planning.artifacts import StageInfo
from ..planning.plan import Plan


@attrs.frozen
class Place:
    """Where a world rank sits: dp replica, pipeline position, and replica of that position."""

    dp_replica: int
    position: int
    replica: int


def place(plan: Plan, rank: int) -> Place:
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's world of {plan.world_size} ranks")
    group, local = divmod(rank, sum(plan.replicas))
    position, replica = plan.routing.place(local)
    return Place(group, position, replica)


@functools.lru_cache(maxsize=64)
def _offsets(counts: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """Ranks per dp replica, and the first rank of each position inside one (kept: called per transfer)."""
    return sum(counts), tuple(itertools.accumulate(counts, initial=0))


def world_rank(plan: Plan, dp_replica: int, position: int, microbatch: int) -> int:
    """The world rank of `dp_replica` that runs `microbatch` at `position`."""
    n, first = _offsets(plan.replicas)
    return dp_replica * n + first[position] + microbatch % plan.replicas[position]


def position_ranks(plan: Plan, position: int) -> tuple[int, ...]:
    """Every world rank that runs `position` (each of its replicas, in every dp replica)."""
    return _position_ranks(plan.replicas, plan.dp, position)


@functools.lru_cache(maxsize=4096)
def _position_ranks(counts: tuple[int, ...], dp: int, position: int) -> tuple[int, ...]:
    n, first = _offsets(counts)
    return tuple(d * n + first[position] + k for d in range(dp) for k in range(counts[position]))


def row(plan: Plan, table: schedules.Table, rank: int) -> tuple[schedules.Action, ...]:
    """The lowered actions `rank` runs: its position's row of `table` with one rank each, else the routed rows
    (`schedules.replica_rows` in the plan's order, with their transfers: `schedules.lower_replicated`)."""
    local = rank % sum(plan.replicas)
    if all(c == 1 for c in plan.replicas):
        return table.rows[local]
    return _routed(plan.schedule, plan.schedule_options, plan.num_stages, plan.microbatches, plan.replicas,
                   plan.replica_order)[local]


@functools.lru_cache(maxsize=16)
def _routed(schedule: str, options: tuple[tuple[str, Any], ...], num_stages: int, microbatches: int,
            counts: tuple[int, ...], order: str) -> tuple[tuple[schedules.Action, ...], ...]:
    def build(m: int) -> schedules.Table:
        return schedules.get(schedule)(num_stages, m, **dict(options))

    replicas = schedules.Replicas(counts)
    rows = schedules.replica_rows(build, microbatches, replicas, order)
    return schedules.lower_replicated(build(microbatches), replicas, rows)


def microbatches(plan: Plan, rank: int) -> tuple[int, ...]:
    """The microbatches (of its dp replica's `plan.microbatches`) that `rank` runs."""
    return plan.routing.microbatches(rank % sum(plan.replicas), plan.microbatches)


def channels(plan: Plan, table: schedules.Table) -> list[tuple[int, int]]:
    """Every ordered (sender, receiver) pair of world ranks that exchange tensors: those of dp replica 0's
    rows (one table row per position with one rank each), repeated in every dp replica."""
    n = sum(plan.replicas)
    local = set()
    for me in range(n):
        for action in row(plan, table, me):
            if action.is_comm:
                peer = world_rank(plan, 0, table.rank_of(action.peer_stage), action.microbatch)
                local.add((me, peer) if action.is_send else (peer, me))
    return sorted((d * n + a, d * n + b) for d in range(plan.dp) for a, b in local)


def grad_groups(plan: Plan, infos: Sequence[StageInfo], table: schedules.Table,
                num_params: int) -> dict[tuple[int, ...], list[int]]:
    """World ranks that hold a copy of each param leaf's grad -> the leaves they must sum. With ZeRO-1
    (`plan.shard_optimizer`) only the copies inside each dp replica: the dp sum is the optimizer's
    reduce-scatter (engine/training/zero.py)."""
    users: dict[int, set[int]] = {}
    for info in infos:
        for pid in info.stage.param_ids:
            users.setdefault(pid, set()).add(table.rank_of(info.stage.index))
    n = sum(plan.replicas)
    parts = [(d,) for d in range(plan.dp)] if plan.shard_optimizer else [tuple(range(plan.dp))]
    groups: dict[tuple[int, ...], list[int]] = {}
    for pid in range(num_params):
        for part in parts:
            ranks = tuple(sorted(r for q in users.get(pid, {0}) for r in position_ranks(plan, q) if r // n in part))
            if len(ranks) > 1:
                groups.setdefault(ranks, []).append(pid)
    return dict(sorted(groups.items()))
