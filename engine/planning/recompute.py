"""Recomputation as a planner decision: per stage, save everything, redo the cheap ops, or redo the forward.

Recomputing trades time for memory, so the planner does it only where the memory limit needs it. A stage
has three levels (`ir.stage_autodiff`'s `recompute`):

| level   | F keeps                                   | the backward runs                          |
|---------|-------------------------------------------|--------------------------------------------|
| False   | every value B and W read (views rebuilt)  | eager autograd's kernels, nothing more     |
| "cheap" | less: norms, copies, pointwise chains are | those ops again (memory-bound kernels:     |
|         | redone from operands kept anyway          | about +10 % elementwise time on a GPT)     |
| True    | only the stage's outputs                  | the whole forward again, then the backward |

The splitter decides between False and True per stage (`stage_costs.split_recompute`, on block sums).
`settle` then costs the split exactly (stage autodiff at each level, cached in the Workshop) and, only
with recompute="auto", walks each rank from the cheapest level up: a rank over the limit turns the cheap
level on for its stages that save everything, and a rank whose stages the split made redo their forward
takes the cheap level instead whenever the rank still fits with it (it is faster: only memory-bound ops
run twice). With memory to spare nothing changes: every stage is at level False and the programs run no
extra kernels. `plan.recompute` (True) and `plan.remat` ("cheap") say which stages do what, and
`print(plan)` lists both.

Compiled programs change the price. A compiler that fuses pointwise work (inductor) folds the cheap
level's norms and pointwise chains into the backward kernels that read them, so they cost no extra kernel
(AOTAutograd's min-cut partitioner recomputes the same ops for the same reason); there the planner starts
every stage at "cheap" (`fused_recompute`, which `engine.parallelize` sets for compiler="inductor" and
"auto" on CUDA), keeping less per microbatch for free.

Why per rank: a rank's peak is the sum over its own stages (`memory.rank_peaks`); changing one rank's
levels leaves the other ranks' peaks as they were, so each rank is settled on its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import schedules

if TYPE_CHECKING:  # the planner hands itself in; no import cycle at run time
    from .candidates import Candidate, Candidates
    from .layout import Layout


def settle(planner: Candidates, layout: Layout, table: schedules.Table, size: int, cuts: Sequence[int],
           recompute: Sequence[bool], *, fine: bool = False, bounds: tuple[int, ...] = ()) -> Candidate:
    """The split `cuts` costed exactly with each stage at the cheapest recompute level that keeps its rank
    within the planner's limit (see the module docstring); `recompute` is the splitter's choice of full
    recomputation per stage. Only `planner.recompute == "auto"` changes levels."""
    free = "cheap" if planner.recompute == "auto" and getattr(planner, "fused_recompute", False) else False
    levels: list[bool | str] = [True if f else free for f in recompute]

    def evaluate() -> Candidate:
        return planner.evaluate(layout, planner.exact(size, cuts, levels), table, fine=fine, bounds=bounds)

    cand = evaluate()
    if planner.recompute != "auto":
        return cand
    over = [r for r, peak in enumerate(cand.rank_memory) if peak > planner.limit]
    plain = [s for r in over for s in table.stages_of(r) if levels[s] is False]
    if plain:
        for s in plain:
            levels[s] = "cheap"
        cand = evaluate()
    for rank in range(table.num_ranks):
        full = [s for s in table.stages_of(rank) if levels[s] is True]
        if not full:
            continue
        for s in full:
            levels[s] = "cheap"
        trial = evaluate()
        if trial.rank_memory[rank] <= planner.limit and trial.step_time <= cand.step_time:
            cand = trial
        else:
            for s in full:
                levels[s] = True
    return cand
