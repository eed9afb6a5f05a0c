"""The Plan: how a model graph is cut into stages and laid out on ranks, with its predictions."""
from __future__ import annotations

import hashlib
import json
from typing import Any

import attrs

import schedules

from ..errors import PlanError
from ..names import abbreviate
from ..units import nbytes


@attrs.frozen
class StagePlan:
    """One stage: equations [start, stop) of the microbatch graph, and its predicted cost."""

    index: int
    start: int
    stop: int
    rank: int
    forward_time: float = 0.0
    backward_input_time: float = 0.0
    backward_weight_time: float = 0.0
    param_bytes: int = 0
    flops: int = 0
    activation_bytes: int = 0
    send_bytes: int = 0
    peak_memory: int = 0
    names: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    num_params: int = 0

    @property
    def time(self) -> float:
        """Predicted seconds for one microbatch's forward + backward."""
        return self.forward_time + self.backward_input_time + self.backward_weight_time


@attrs.frozen
class Plan:
    """Stages, placement and schedule for one model on `world_size = sum(replicas) · dp` ranks.

    `replicas[q]` ranks run pipeline position q (all ones: `world_size = pipeline_depth · dp`, world rank r
    is replica r // pipeline_depth at position r % pipeline_depth). Unequal counts route each of the
    `microbatches` of a dp replica to one rank of each position (`schedules.Replicas`: world rank
    `d · sum(replicas) + sum(replicas[:q]) + k` is replica k of position q in dp replica d), each replica
    ordering its actions as `replica_order` says (`schedules.replica_rows`). Stage s runs
    on pipeline position `table.rank_of(s)`. `equal_step_time` is the best prediction with equal replicas
    when the planner chose unequal ones (0 otherwise).
    """

    schedule: str
    num_stages: int
    pipeline_depth: int
    dp: int
    microbatches: int
    cuts: tuple[int, ...]
    stages: tuple[StagePlan, ...]
    schedule_options: tuple[tuple[str, Any], ...] = ()
    predicted_step_time: float = 0.0
    bubble_fraction: float = 0.0
    graph_hash: str = ""
    device: str = "cpu"
    memory_limit: int | None = None
    link: str = ""
    microbatch_size: int = 0
    num_eqns: int = 0
    allreduce_time: float = 0.0
    # per pipeline position: the memory model's peak that the split was checked against (optimizer state and
    # its margin included); the bytes a step holds are replayed from the programs by `Step.memory()`
    rank_memory: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    # per stage: F keeps only the stage's outputs and B redoes the forward (activation recomputation)
    recompute: tuple[bool, ...] = attrs.field(
        default=attrs.Factory(lambda self: (False,) * self.num_stages, takes_self=True),
        converter=lambda flags: tuple(bool(f) for f in flags))
    # schedule="auto": every (schedule, layout) the planner simulated, with its predicted step time in seconds
    # (inf where it did not fit, with the reason); the chosen one is this plan's schedule and layout
    considered: tuple[tuple[str, str, float], ...] = attrs.field(default=(), converter=lambda rows: tuple(
        (str(name), str(layout), float(t)) for name, layout, t in rows))
    # per stage: B and W redo norms, copies and pointwise chains instead of F saving them (cheap
    # recomputation: less memory, extra memory-bound kernels); the planner turns it on only where memory needs it
    remat: tuple[bool, ...] = attrs.field(
        default=attrs.Factory(lambda self: (False,) * self.num_stages, takes_self=True),
        converter=lambda flags: tuple(bool(f) for f in flags))
    # ZeRO-1: each dp replica steps its 1/dp share of the optimizer state (engine.optim.ShardedOptimizer)
    shard_optimizer: bool = False
    # per memory term (params, grads, master, optimizer, comm buffers, activations, margin): bytes per position
    memory_terms: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(
        default=(), converter=lambda terms: tuple((str(k), tuple(int(b) for b in v)) for k, v in terms))
    recipe: str = ""  # the training recipe the memory was planned for (engine.planning.recipe), or ""
    # per pipeline position: how many ranks run it inside a dp replica (see the class docstring)
    replicas: tuple[int, ...] = attrs.field(
        default=attrs.Factory(lambda self: (1,) * self.pipeline_depth, takes_self=True),
        converter=lambda counts: tuple(int(c) for c in counts))
    equal_step_time: float = 0.0
    replica_order: str = "split"  # with unequal replicas: how each orders its actions (`schedules.replica_rows`)

    def __attrs_post_init__(self) -> None:
        if len(self.replicas) != self.pipeline_depth or min(self.replicas, default=1) < 1:
            raise PlanError(f"replicas {self.replicas} must give one count >= 1 for each of the {self.pipeline_depth} "
                            "pipeline positions (or leave it out: one each)")
        if any(self.microbatches % c for c in self.replicas):
            raise PlanError(f"{self.microbatches} microbatches do not split evenly over replicas {self.replicas}: "
                            "every replica of a stage runs the same share; use a microbatch count every replica "
                            "count divides")
        for name, flags in (("recompute", self.recompute), ("remat", self.remat)):
            if len(flags) != self.num_stages:
                raise PlanError(f"{name} has {len(flags)} flags for {self.num_stages} stages; give one "
                                "bool per stage (or leave it out: no recomputation)")
        if self.shard_optimizer and any(c > 1 for c in self.replicas):
            raise PlanError(f"ZeRO-1 (shard_optimizer) with replicas per stage {self.replicas} is not supported yet: "
                            "pass shard_optimizer=False, or equal replicas (dp)")

    @property
    def world_size(self) -> int:
        return sum(self.replicas) * self.dp

    @property
    def routing(self) -> schedules.Replicas:
        """How the ranks of one dp replica run the pipeline positions (`schedules.Replicas`)."""
        return schedules.Replicas(self.replicas)

    def table(self) -> schedules.Table:
        """The (unlowered) schedule table of this plan."""
        return schedules.get(self.schedule)(self.num_stages, self.microbatches, **dict(self.schedule_options))

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self, recurse=True), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        d["stages"] = tuple(StagePlan(**{**s, "names": tuple(s["names"])}) for s in d["stages"])
        d["cuts"] = tuple(d["cuts"])
        d["schedule_options"] = tuple((k, _tupled(v)) for k, v in d["schedule_options"])
        return cls(**d)

    def __str__(self) -> str:
        return format_plan(self)


def _tupled(value: Any) -> Any:
    """JSON's lists back as the tuples a plan holds (a schedule's costs are tuples of tuples)."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


_COLUMNS = (("stage", 5), ("rank", 4), ("eqns", 9), ("modules", 26), ("params M", 8), ("GFLOP", 8),
            ("fwd ms", 7), ("bwd ms", 7), ("act", 9), ("peak", 9), ("send", 9))
_NAMES = 3  # the one left-aligned column


def _cells(values: tuple[str, ...]) -> str:
    return " ".join(f"{v:<{w}}" if i == _NAMES else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(values, _COLUMNS)))


def _row(s: StagePlan, plan: Plan) -> tuple[str, ...]:
    """`rank`: the world ranks of dp replica 0 that run the stage (its position's replicas)."""
    width = _COLUMNS[_NAMES][1]
    names = abbreviate(s.names) or "-"
    shown = names if len(names) <= width else names[:width - 1] + "~"
    return (str(s.index), _span(plan.routing.ranks(s.rank)), f"{s.start}-{s.stop - 1}", shown,
            f"{s.num_params / 1e6:.1f}", f"{s.flops / 1e9:.1f}", f"{s.forward_time * 1e3:.2f}",
            f"{(s.backward_input_time + s.backward_weight_time) * 1e3:.2f}", nbytes(s.activation_bytes),
            nbytes(s.peak_memory), nbytes(s.send_bytes))


def format_plan(plan: Plan) -> str:
    """A table of the stages (RaNNC-style log: per stage its equations, modules, size, time, memory and
    traffic per microbatch), then the layout and the predicted step."""
    lines = [_cells(tuple(name for name, _ in _COLUMNS)), *(_cells(_row(s, plan)) for s in plan.stages)]
    opts = "".join(f", {k}={v}" for k, v in plan.schedule_options if k not in ("costs", "search"))
    limit = nbytes(plan.memory_limit) if plan.memory_limit else "none"
    ranks = ", ".join(nbytes(m) for m in plan.rank_memory) or "-"
    lines += [
        f"{plan.schedule}{opts}: {plan.num_stages} stages on {_positions(plan)} x dp {plan.dp} = "
        f"{plan.world_size} ranks; {plan.microbatches} microbatches of {plan.microbatch_size}",
        *_replica_lines(plan),
        f"predicted step {plan.predicted_step_time * 1e3:.2f} ms (dp all-reduce {plan.allreduce_time * 1e3:.2f} ms), "
        f"bubble {plan.bubble_fraction:.1%}",
        f"device {plan.device}, link {plan.link or '-'}, memory limit {limit}; planned peak per rank {ranks}",
    ]
    if plan.shard_optimizer:
        lines.append(f"ZeRO-1: optimizer state split over the dp {plan.dp} replicas of each stage")
    lines += _terms(plan)
    if dict(plan.schedule_options).get("costs") is not None:
        if dict(plan.schedule_options).get("search") is False:
            lines.append(f"{plan.schedule} order: the fastest hand-built one under the stages' F, B, W and transfer "
                         "times (the search found none faster; schedules.from_costs)")
        else:
            lines.append(f"{plan.schedule} order built for the stages' F, B, W and transfer times (schedules.from_costs)")
    if any(plan.recompute):
        lines.append(f"activation recomputation on stages {[k for k, r in enumerate(plan.recompute) if r]}")
    if any(plan.remat):
        lines.append(f"cheap recomputation (norms, pointwise) on stages {[k for k, r in enumerate(plan.remat) if r]}")
    if plan.considered:
        lines.append('schedule="auto" considered (predicted step):')
        width = max(len(name) for name, _, _ in plan.considered)
        lines += [f"  {name:<{width}}  {f'{t * 1e3:.2f} ms' if t != float('inf') else '-':>10}  {layout}"
                  for name, layout, t in plan.considered]
    return "\n".join(lines)


def _positions(plan: Plan) -> str:
    if len(set(plan.replicas)) == 1 and plan.replicas[0] == 1:
        return f"{plan.pipeline_depth} ranks"
    return f"{sum(plan.replicas)} ranks (replicas {'x'.join(map(str, plan.replicas))})"


def _replica_lines(plan: Plan) -> list[str]:
    """Where each pipeline position's replicas are, and why the planner chose unequal ones."""
    if len(set(plan.replicas)) == 1 and plan.replicas[0] == 1:
        return []
    routing, v = plan.routing, plan.num_stages // plan.pipeline_depth
    where = ", ".join(f"{_held(plan, q, v)} x{c} on rank{'s' if c > 1 else ''} {_span(routing.ranks(q))}"
                      for q, c in enumerate(plan.replicas))
    lines = [f"replicas per stage: {where}{' in dp replica 0' if plan.dp > 1 else ''}; microbatch i runs on replica "
             f"i mod count, in the {plan.replica_order} order"]
    if plan.equal_step_time > 0:
        gain = plan.equal_step_time / plan.predicted_step_time - 1 if plan.predicted_step_time > 0 else 0.0
        lines.append(f"unequal replicas chosen: predicted {plan.predicted_step_time * 1e3:.2f} ms against "
                     f"{plan.equal_step_time * 1e3:.2f} ms for the best plan with equal replicas ({gain:.0%} faster)")
    return lines


def _held(plan: Plan, position: int, v: int) -> str:
    stages = [s.index for s in plan.stages if s.rank == position] or [position]
    return f"stage {stages[0]}" if v == 1 else f"stages {','.join(map(str, stages))}"


def _span(ranks: range) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _terms(plan: Plan) -> list[str]:
    """Memory per rank, term by term (one column per pipeline position; dp replicas hold the same)."""
    if not plan.memory_terms:
        return []
    ranks = len(plan.memory_terms[0][1])
    shown = list(range(ranks)) if ranks <= 8 else [*range(4), *range(ranks - 4, ranks)]
    replica = ", dp replica 0 (each alike)" if plan.dp > 1 else ""
    head = f"memory per rank{' (' + plan.recipe + ')' if plan.recipe else ''}{replica}:"
    cols = " ".join(f"{'rank ' + _span(plan.routing.ranks(r)):>9}" for r in shown)
    rows = [f"  {name:<13}" + " ".join(f"{nbytes(v[r]):>9}" for r in shown) for name, v in plan.memory_terms]
    total = [sum(v[r] for _, v in plan.memory_terms) for r in shown]
    return [head, f"  {'':<13}{cols}", *rows, f"  {'total':<13}" + " ".join(f"{nbytes(t):>9}" for t in total)]


def fingerprint(items: Any) -> str:
    """sha256 of the JSON of plans/programs: equal on every rank or the run refuses to start."""
    text = json.dumps(items, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
