"""The memory model: bytes a stage needs per microbatch and statically, and the peak of each rank and stage.

A stage holds its parameters with their grads and optimizer state (`param bytes x param_factor`:
without a training recipe `2 + optimizer_factor`, Adam in the params' dtype; with one, the recipe's terms,
engine/planning/recipe.py, where ZeRO-1 divides master weights and optimizer state by the stage's dp), one send and one receive buffer each way, the temporaries of the one F, B or
W running, and per microbatch in flight the activations F saved for B/W plus the received input B/W
read. How many microbatches are in flight is a property of the schedule: `schedules.simulate` walks
each rank's row (a rank runs its actions in order, so the peak is exact for any timing); this module
gives it the bytes and reads the peaks back. A rank holding several stages (interleaved, ZB-V) peaks at
the largest sum over its stages, not at the sum of peaks. (The bytes a step really holds are replayed
from the emitted programs by `engine.execution.footprint`.)
"""
from __future__ import annotations

from typing import Sequence

import attrs
import torch

import schedules
from schedules.action import BW, F, W

from .recipe import Recipe


@attrs.frozen
class StageMemory:
    """What one stage keeps: bytes for the whole step; per microbatch from F to its backward; and, when
    the schedule splits B and W, per microbatch from B to W instead (`after_b`: what W still reads of
    F's saved values and the stage input, plus what B hands it; None: all of F's plus `b_to_w`)."""

    static: float
    per_microbatch: float
    b_to_w: float = 0.0
    after_b: float | None = None
    workspace: float = 0.0  # temporaries of the one F, B or W running: a rank counts its largest stage's

    @property
    def between_b_and_w(self) -> float:
        return self.per_microbatch + self.b_to_w if self.after_b is None else self.after_b


@attrs.frozen
class MemoryModel:
    """Bytes of a stage from its parameters and activations; `margin` covers allocator slack."""

    optimizer_factor: float = 2.0
    margin: float = 0.10
    recipe: Recipe | None = None
    param_dtype: torch.dtype = torch.float32  # the params' dtype the recipe's bytes per element start from
    dp: int = 1
    zero: bool = False  # ZeRO-1 on for this layout (the recipe's shard_optimizer, decided per layout)
    _factor: float = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:  # the splitter asks for it millions of times: sum the terms once
        object.__setattr__(self, "_factor", sum(self.terms(1.0).values()))

    def terms(self, param_bytes: float) -> dict[str, float]:
        """Bytes of each static term for `param_bytes` of params: params, grads, master, optimizer."""
        if self.recipe is None:
            return {"params": param_bytes, "grads": param_bytes, "master": 0.0,
                    "optimizer": param_bytes * self.optimizer_factor}
        per = self.recipe.terms(self.param_dtype, zero=self.zero, dp=self.dp)
        return {k: param_bytes * v / per["params"] for k, v in per.items()}

    @property
    def param_factor(self) -> float:
        """Static bytes per param byte: params + grads + master + optimizer state."""
        return self._factor

    def stage(self, *, param_bytes: float, saved_bytes: float, recv_bytes: float = 0, send_bytes: float = 0,
              b_to_w_bytes: float = 0, workspace_bytes: float = 0, after_b_bytes: float | None = None) -> StageMemory:
        """A stage's needs: weights, grads, optimizer state, comm buffers and the temporaries of one F, B or W
        at a time; per microbatch, what it saved and received (and from B to W, `after_b_bytes`)."""
        static = param_bytes * self.param_factor + 2 * (recv_bytes + send_bytes)
        return StageMemory(static, saved_bytes + recv_bytes, b_to_w_bytes, after_b_bytes, workspace_bytes)

    def peak(self, memory: StageMemory, live: int) -> float:
        """A stage's peak bytes with `live` microbatches in flight (B/W split ignored), margin included."""
        return (memory.static + memory.workspace + live * memory.per_microbatch) * (1 + self.margin)


def peak_live(table: schedules.Table) -> tuple[int, ...]:
    """Largest number of microbatches in flight at each stage: `schedules.simulate(table).stage_peak_live`
    without the timing. A rank runs its row in order, so the count needs only the rows (simulate's own
    walk): a stage's microbatch is live from its F until its W or BW. At p = 128 the timed simulation
    takes about a second, and the planner asks once per layout."""
    top = [0] * table.num_stages
    for row in table.rows:
        now: dict[int, int] = {}
        for action in row:
            if not action.is_compute:
                continue
            s = action.stage
            if action.kind == F:
                now[s] = now.get(s, 0) + 1
                top[s] = max(top[s], now[s])
            elif action.kind in (W, BW):
                now[s] = now.get(s, 0) - 1
    return tuple(top)


def stage_costs_of(table: schedules.Table, stages: Sequence[StageMemory]) -> schedules.Costs:
    """The simulator's memory view of `stages` on `table` (times left at their defaults)."""
    return schedules.Costs(
        memory_per_microbatch=tuple(m.per_microbatch for m in stages), memory_b_to_w=tuple(m.b_to_w for m in stages),
        static_memory=tuple(rank_static(table, stages, r) for r in range(table.num_ranks)),
        memory_after_b=tuple(m.between_b_and_w for m in stages))


def stage_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel,
                sim: schedules.Simulation | None = None) -> tuple[float, ...]:
    """Peak bytes of each stage on its own, margin included (`sim`: the table simulated with these
    stages' memory, if the caller has it)."""
    sim = sim or schedules.simulate(table, stage_costs_of(table, stages))
    return tuple((m.static + m.workspace + d) * (1 + model.margin) for m, d in zip(stages, sim.stage_peak_memory))


def rank_peaks(table: schedules.Table, stages: Sequence[StageMemory], model: MemoryModel,
               sim: schedules.Simulation | None = None) -> tuple[float, ...]:
    """Peak bytes of each rank: its stages' static bytes plus the largest in-flight sum, margin included
    (the walk over each rank's row is `schedules.simulate`'s)."""
    sim = sim or schedules.simulate(table, stage_costs_of(table, stages))
    return tuple(peak * (1 + model.margin) for peak in sim.peak_memory)


def rank_static(table: schedules.Table, stages: Sequence[StageMemory], rank: int) -> float:
    """Bytes a rank holds whatever the microbatches do: its stages' static bytes, and the workspace of
    its largest stage (one program runs at a time)."""
    mine = table.stages_of(rank)
    return sum(stages[s].static for s in mine) + max((stages[s].workspace for s in mine), default=0.0)



TERMS = ("params", "grads", "master", "optimizer", "comm buffers", "activations", "margin")


def rank_terms(table: schedules.Table, stages: Sequence[object], model: MemoryModel,
               peaks: Sequence[float]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each rank's planned peak (`peaks`, margin included) cut into TERMS: the static ones from its stages'
    param bytes through the recipe, comm buffers, then activations (in flight, and the running program's
    temporaries) and the allocator margin. `stages`: StageCosts (param_bytes, recv_bytes, send_bytes)."""
    rows = []
    for r, peak in enumerate(peaks):
        mine = [stages[s] for s in table.stages_of(r)]
        static = model.terms(float(sum(s.param_bytes for s in mine)))  # type: ignore[attr-defined]
        comm = 2.0 * sum(s.recv_bytes + s.send_bytes for s in mine)  # type: ignore[attr-defined]
        held = peak / (1 + model.margin)
        rows.append([*static.values(), comm, max(0.0, held - sum(static.values()) - comm), peak - held])
    return tuple((name, tuple(int(row[k]) for row in rows)) for k, name in enumerate(TERMS))


def with_recipe(model: MemoryModel | None, recipe: Recipe | None, params: object) -> MemoryModel:
    """`model` (default MemoryModel()) planning for `recipe`, from the dtype holding most of `params`' bytes."""
    model = model or MemoryModel()
    if recipe is None:
        return model
    from torch.utils import _pytree as pytree

    sizes: dict[torch.dtype, int] = {}
    for x in pytree.tree_leaves(params):
        dtype = getattr(x, "dtype", None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            numel = 1
            for d in x.shape:
                numel *= int(d)
            sizes[dtype] = sizes.get(dtype, 0) + numel * torch.empty((), dtype=dtype).element_size()
    dtype = max(sizes, key=sizes.__getitem__) if sizes else torch.float32
    return attrs.evolve(model, recipe=recipe, param_dtype=dtype)
