"""Stage costs: F/B/W seconds, bytes kept and sent, for a split, estimated from blocks or exact.

Estimates sum the blocks' numbers (cheap, used while searching). Exact costs slice the graph with
`ir.split` and time the F, B and W graphs that `ir.stage_autodiff` builds; saved bytes are what F
really hands to B and W. Exact costs are cached per equation range, since a stage's slice depends only
on its own range (and whether it recomputes).

A stage with activation recomputation keeps only its outputs per microbatch; its B redoes the forward
(seconds added to B) and holds one microbatch's activations while B and W run (its workspace).
`split_recompute` is the splitter with that choice per stage: never, always, or "auto" (only where a
stage does not fit without).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import attrs
import numpy as np

import ir
import schedules

from .artifacts import autodiff, level_at
from .blocks import Blocks
from .op_costs import CostModel
from ..errors import PlanError, SplitError
from ..units import nbytes
from .memory import MemoryModel, StageMemory, rank_static
from .split import FIX, BlockCosts, Partition, partition, split_costs


@attrs.frozen
class StageCost:
    """One stage of equations [start, stop): per-microbatch seconds and bytes."""

    start: int
    stop: int
    forward: float
    backward_input: float
    backward_weight: float
    flops: int
    params: tuple[int, ...]        # graph param indices it reads
    param_bytes: int
    num_params: int
    saved_bytes: int               # F -> B/W per microbatch (exact: slots B or W read from F)
    b_to_w_bytes: int              # B -> W per microbatch (exact only; 0 in estimates)
    recv_bytes: int
    send_bytes: int
    workspace_bytes: int = 0       # peak temporaries of one F, B or W (exact; estimated when recomputing)
    fused_workspace_bytes: int | None = None  # the same when B and W run fused as BW (None: as above)
    after_b_bytes: int | None = None  # per microbatch from B to W when split (exact; None: saved + b_to_w)
    exact: bool = False
    recompute: bool = False        # activation recomputation: B redoes F, F keeps only the outputs
    remat: bool = False            # cheap recomputation: B/W redo norms and pointwise chains (exact only)

    @property
    def time(self) -> float:
        return self.forward + self.backward_input + self.backward_weight

    def memory(self, model: MemoryModel, *, split_bw: bool = True) -> StageMemory:
        """Bytes for the memory model; `split_bw` False when the schedule runs this stage's B and W fused."""
        fused = self.fused_workspace_bytes
        workspace = self.workspace_bytes if split_bw or fused is None else fused
        return model.stage(param_bytes=self.param_bytes, saved_bytes=self.saved_bytes, recv_bytes=self.recv_bytes,
                           send_bytes=self.send_bytes, b_to_w_bytes=self.b_to_w_bytes, workspace_bytes=workspace,
                           after_b_bytes=self.after_b_bytes)


def _param_stats(graph: ir.Graph, params: Sequence[int]) -> tuple[int, int]:
    return (sum(graph.inputs[i].aval.nbytes for i in params), sum(graph.inputs[i].aval.numel for i in params))


def estimate(graph: ir.Graph, blocks: Blocks, bounds: Sequence[int], saved_scale: Sequence[float] | None = None,
             recompute: Sequence[bool] = ()) -> tuple[StageCost, ...]:
    """Stages of blocks [bounds[k], bounds[k+1]) from the blocks' sums; the first stage has no B
    (nothing upstream needs its input grad), so its backward counts as W. A stage with `recompute[k]`
    keeps nothing per microbatch, redoes its forward in the backward, and holds one microbatch's
    activations while it does (its workspace)."""
    scale = saved_scale or [1.0] * blocks.num_blocks
    out = []
    for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
        params = tuple(sorted(frozenset().union(*blocks.params[i:j])))
        nbytes, numel = _param_stats(graph, params)
        redo = k < len(recompute) and recompute[k]
        f = sum(blocks.forward[i:j])
        b, w = sum(blocks.backward_input[i:j]) + (f if redo else 0.0), sum(blocks.backward_weight[i:j])
        saved = int(sum(blocks.saved[x] * scale[x] for x in range(i, j)))
        out.append(StageCost(
            start=blocks.bounds[i], stop=blocks.bounds[j], forward=f,
            backward_input=0.0 if k == 0 else b, backward_weight=w + b if k == 0 else w,
            flops=sum(blocks.flops[i:j]), params=params, param_bytes=nbytes, num_params=numel,
            saved_bytes=0 if redo else saved, b_to_w_bytes=0, recv_bytes=blocks.cut_bytes[i],
            send_bytes=blocks.cut_bytes[j], workspace_bytes=saved if redo else 0, recompute=redo))
    return tuple(out)


def _slot_bytes(ad: ir.StageAD, slots: set[int]) -> int:
    return ad.slot_bytes(slots)  # F's outputs on one storage once, as the runtime holds them


def transient_bytes(g: ir.Graph) -> int:
    """Peak bytes of the values `g` makes and frees again (not its outputs, not views), run in order
    with each value freed after its last use, as the runtime does."""
    return ir.run_bytes(g).transient


def _backward_transient(part: ir.Part, grad_slots: set[int]) -> int:
    """Temporaries of a W or BW program as the runtime runs it: each param grad is added into its
    accumulator as soon as it is made and dies there, so it counts while it lives."""
    params = tuple(k for k, s in enumerate(part.out_slots) if s in grad_slots)
    return ir.run_bytes(part.graph, params).transient


Differentiate = Callable[[ir.Stage, "bool | str"], ir.StageAD]  # (stage, recompute level) -> its F/B/W programs


def autodiff_on(device: str | None) -> Differentiate:
    """Stage autodiff with nothing kept (planning keeps its programs in `artifacts.Workshop`)."""
    return lambda stage, recompute: autodiff(stage, recompute, device=device)


def _exact_stage(graph: ir.Graph, stage: ir.Stage, model: CostModel, differentiate: Differentiate,
                 recompute: bool | str = False) -> StageCost:
    """Costs of a stage from its F/B/W graphs at a recompute level (False, "cheap", True: see
    `ir.stage_autodiff`). With True, B's graph holds the redone forward, so its time includes it, and what
    B computes for W (the recomputed activations W reads) lives while B and W run: B's temporaries plus
    that hand-over are the stage's workspace. With "cheap", B and W's graphs hold the redone norms and
    pointwise ops, so their times include them."""
    g = stage.graph
    n_params, n_batch = len(stage.param_ids), len(stage.batch_ids)
    ad = differentiate(stage, recompute)
    f, b, w = ad.forward, ad.backward_input, ad.backward_weight
    n_in = len(g.inputs)
    from_f = {s for s in (*b.in_slots, *w.in_slots) if s >= n_in and s in set(f.out_slots)}
    grads = {s for s in ad.grad_slots if s is not None}
    b_to_w = set(w.in_slots) & (set(b.out_slots) - grads)
    order = list(graph.defined())
    nbytes, numel = _param_stats(graph, stage.param_ids)
    handed = _slot_bytes(ad, b_to_w) if recompute is True else 0
    acts_in = set(range(n_params + n_batch, n_in))
    param_grads = {s for s in ad.grad_slots[:n_params] if s is not None}
    cts = {s for s in ad.ct_slots if s is not None}
    after_b = set(w.in_slots) & (from_f | acts_in | cts) | b_to_w  # what waits for W once B is done
    fx, bx, wx = _scales(graph, stage, model)
    forward = model.graph_time(f.graph)
    b_time = model.graph_time(b.graph, backward=True)  # calibrated ops at the backward program scale
    if recompute is True:  # B redoes the forward: that part at the forward's scale
        b_time += forward - model.graph_time(f.graph, backward=True)
    return StageCost(
        start=stage.start, stop=stage.stop, forward=forward * fx, backward_input=b_time * bx,
        backward_weight=(model.graph_time(w.graph, backward=True)
                         + model.params_accumulate_time(graph, stage.param_ids)) * wx,
        flops=sum(ir.eqn_cost(e).flops for e in g.eqns), params=tuple(stage.param_ids), param_bytes=nbytes,
        num_params=numel, saved_bytes=_slot_bytes(ad, from_f), b_to_w_bytes=_slot_bytes(ad, b_to_w),
        recv_bytes=sum(order[v].aval.nbytes for v in stage.acts_in),
        send_bytes=sum(order[v].aval.nbytes for v in stage.acts_out),
        workspace_bytes=max(transient_bytes(f.graph), transient_bytes(b.graph) + handed,
                            _backward_transient(w, param_grads) + handed),
        fused_workspace_bytes=max(transient_bytes(f.graph), _backward_transient(ad.backward, param_grads)),
        after_b_bytes=_slot_bytes(ad, after_b),
        exact=True, recompute=recompute is True, remat=recompute == "cheap")


def _scales(graph: ir.Graph, stage: ir.Stage, model: CostModel) -> tuple[float, float, float]:
    """The measured F, B, W ratios of `stage`'s equations ((1, 1, 1) unless programs were measured); a stage
    with no input activations has no B and its W graph is its whole backward, at the whole backward's ratio."""
    fx, bx, wx = model.stage_scale(graph, stage.start, stage.stop)
    if not stage.acts_in:
        wx = model.stage_fused_scale(graph, stage.start, stage.stop)
    return fx, bx, wx


def exact(graph: ir.Graph, cuts: Sequence[int], model: CostModel, *, device: str | None = None,
          cache: dict[tuple[int, int, bool | str], StageCost] | None = None, recompute: Sequence[bool | str] = (),
          differentiate: Differentiate | None = None) -> tuple[StageCost, ...]:
    """Exact costs of the stages `ir.split(graph, cuts)`, traced through stage autodiff (stage k at
    recompute level `recompute[k]`: False, "cheap" or True; `differentiate` makes the programs, by default
    afresh on `device`)."""
    cache = {} if cache is None else cache
    differentiate = differentiate or autodiff_on(device)
    out = []
    for stage in ir.split(graph, cuts):
        redo = level_at(recompute, stage.index)
        key = (stage.start, stage.stop, redo)
        if key not in cache:
            cache[key] = _exact_stage(graph, stage, model, differentiate, redo)
        out.append(cache[key])
    return tuple(out)


def exact_blocks(graph: ir.Graph, blocks: Blocks, model: CostModel, *, device: str | None = None,
                 split_bw: bool = False, differentiate: Differentiate | None = None) -> Blocks:
    """`blocks` with F/B/W seconds and saved bytes from stage autodiff of each block; blocks that print
    alike (a model's N identical layers) are differentiated once. A block's saved bytes include its
    input (inside a stage, a saved activation) and, when the schedule runs B and W apart (`split_bw`),
    what B hands to W."""
    costs: dict[str, StageCost] = {}
    per_block = []
    differentiate = differentiate or autodiff_on(device)
    stages = ir.split(graph, blocks.bounds[1:-1])
    plain = attrs.evolve(model, measured=None, placed=False)  # alike blocks cost alike; scales differ by place
    for stage in stages:
        key = _core(stage)
        if key not in costs:
            costs[key] = _exact_stage(graph, stage, plain, differentiate)
        fx, bx, wx = _scales(graph, stage, model)
        c = costs[key]
        per_block.append(attrs.evolve(c, forward=c.forward * fx, backward_input=c.backward_input * bx,
                                      backward_weight=c.backward_weight * wx))
    order = list(graph.defined())
    recv = [sum(order[v].aval.nbytes for v in st.acts_in) for st in stages]  # each block's own, pass-through too
    return attrs.evolve(
        blocks, forward=tuple(c.forward for c in per_block),
        backward_input=tuple(c.backward_input for c in per_block),
        backward_weight=tuple(c.backward_weight for c in per_block),
        saved=tuple(c.saved_bytes + r + (c.b_to_w_bytes if split_bw else 0) for c, r in zip(per_block, recv)))


def _core(stage: ir.Stage) -> str:
    """What a block's F/B/W times depend on: its equations and the values they read and make, without the
    values that only pass through it (a later stage's skip input, the aux leaves a loss function returns:
    BatchNorm's statistics from every earlier layer), which would make every block of a model distinct."""
    g = stage.graph
    used = {v for e in g.eqns for v in e.inputs}
    eqns = tuple(e for e in g.eqns if not (e.op == "aten.detach.default" and not set(e.out_vars) & used))
    read = {v for e in eqns for v in e.inputs}  # a value detached again only to be passed on is not the block's
    made = {v for e in eqns for v in e.out_vars}
    core = ir.Graph(tuple(v for v in g.inputs if v in read), eqns, tuple(o for o in g.outputs if o in made),
                    num_params=sum(1 for v in g.params if v in read))
    return f"{core}|{stage.is_last}"


def splits_bw(table: schedules.Table) -> bool:
    """Whether the schedule runs B and W as separate actions (so W's inputs wait in memory); otherwise
    every backward is one fused BW program."""
    return any(a.kind == "W" for row in table.rows for a in row)


def mostly_split(table: schedules.Table) -> bool:
    """Whether most of the schedule's backwards run as B and W apart: how its stages' backward is costed
    (`CostModel.split_backward`). dualpipev mixes them (at p = 4 and 16 microbatches, 22 B-W pairs beside 106
    fused BW), and a stage's cost has one backward: the split's overhead over the fused (4-7 % on a Llama
    block, 4 x H100) goes to the kind most of them are."""
    kinds = [a.kind for row in table.rows for a in row]
    return kinds.count(schedules.W) >= max(1, kinds.count(schedules.BW))


def schedule_costs(stages: Sequence[StageCost], table: schedules.Table, model: CostModel,
                   memory: MemoryModel) -> schedules.Costs:
    """The simulator's view of these stages: times, transfer bytes, memory per rank, and the host's launches
    where the calibration measured them (`Calibration.launch`: each program issued in that share of its time,
    so a launch-bound stage's host is what its rank follows)."""
    mems = [s.memory(memory, split_bw=splits_bw(table)) for s in stages]
    static = tuple(rank_static(table, mems, r) for r in range(table.num_ranks))
    launch = model.calibration.launch if model.calibration is not None else None
    host = {} if launch is None else {
        "issue_forward": tuple(launch[0] * s.forward for s in stages),
        "issue_backward_input": tuple(launch[1] * s.backward_input for s in stages),
        "issue_backward_weight": tuple(launch[1] * s.backward_weight for s in stages)}
    return schedules.Costs(
        forward=tuple(s.forward for s in stages), backward_input=tuple(s.backward_input for s in stages),
        backward_weight=tuple(s.backward_weight for s in stages), comm_latency=model.link.latency,
        comm_bandwidth=model.link.bandwidth, activation_bytes=tuple(float(s.send_bytes) for s in stages),
        memory_per_microbatch=tuple(m.per_microbatch for m in mems),
        memory_b_to_w=tuple(m.b_to_w for m in mems), static_memory=static,
        memory_after_b=tuple(m.between_b_and_w for m in mems), **host)


# -- activation recomputation per stage ------------------------------------------------------------------

FIX_NO_RECOMPUTE = ("make it fit with more pipeline stages or a smaller microbatch (more microbatches per step); "
                    "or raise memory_limit")


def recompute_mode(value: bool | str) -> bool | str:
    """False, True or "auto" (any case); PlanError for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() == "auto":
        return "auto"
    raise PlanError(f"recompute must be False (never), True (every stage) or 'auto' (only stages that do not fit "
                    f"memory without it), got {value!r}")


@attrs.frozen
class RecomputeCosts:
    """Block ranges as stages that recompute: F keeps nothing per microbatch, B redoes F (its seconds
    are added) and holds that one microbatch's activations while it runs (a workspace, not per microbatch)."""

    costs: BlockCosts
    forward: tuple[float, ...]      # per block, seconds of F (paid twice)
    _fwd_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _param_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _saved_sum: tuple[float, ...] = attrs.field(init=False, repr=False, eq=False)
    _fwd_array: np.ndarray = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name, values in (("_fwd_sum", self.forward), ("_param_sum", self.costs.param_bytes),
                             ("_saved_sum", self.costs.saved)):
            object.__setattr__(self, name, tuple(itertools.accumulate(values, initial=0.0)))
        object.__setattr__(self, "_fwd_array", np.asarray(self._fwd_sum, dtype=np.float64))

    def time(self, i: Any, j: Any) -> Any:
        """Seconds per microbatch of blocks [i, j) recomputing (index arrays give a grid: `BlockCosts.sums`)."""
        f = self._fwd_array if isinstance(i, np.ndarray) else self._fwd_sum
        return self.costs.stage_time(i, j) + f[j] - f[i]

    def peak(self, i: Any, j: Any, live: int, memory: MemoryModel) -> Any:
        at = self.costs.sums(i)
        p, s, cut = at("_param_sum"), at("_saved_sum"), at("cut_bytes")
        m = memory.stage(param_bytes=p[j] - p[i], saved_bytes=0, recv_bytes=cut[i], send_bytes=cut[j],
                         workspace_bytes=s[j] - s[i])
        return memory.peak(m, live)


def split_recompute(rc: RecomputeCosts, num_stages: int, *, mode: bool | str, live: Sequence[int],
                    budgets: Sequence[float], memory: MemoryModel,
                    names: Sequence[str] = ()) -> tuple[Partition, tuple[bool, ...]]:
    """The fastest split and which of its stages recompute. `mode` False: none; True: all; "auto": a
    stage recomputes only when it does not fit its budget without (and does with; it then pays the
    redone forward), so with room to spare this is exactly `split_costs`."""
    costs = rc.costs
    if mode is False:
        try:
            return split_costs(costs, num_stages, live=live, budgets=budgets, memory=memory, names=names), \
                (False,) * num_stages
        except SplitError as err:
            helps = costs.num_blocks >= num_stages and _partition(rc, num_stages, "auto", live, budgets, memory)
            raise SplitError(_retell(str(err), helps=bool(helps))) from None
    if num_stages > costs.num_blocks:
        split_costs(costs, num_stages, live=live, budgets=budgets, memory=memory)  # raises the count error
    found = _partition(rc, num_stages, mode, live, budgets, memory)
    if found is None:
        raise SplitError(_recompute_infeasible(rc, num_stages, live, budgets, memory, names))
    return found


def _partition(rc: RecomputeCosts, num_stages: int, mode: bool | str, live: Sequence[int],
               budgets: Sequence[float], memory: MemoryModel) -> tuple[Partition, tuple[bool, ...]] | None:
    costs = rc.costs

    def plain(s: int, i: Any, j: Any) -> Any:  # grids of index arrays (`partition(grid=True)`) or one range
        if mode is True:
            return np.zeros(np.broadcast(i, j).shape, dtype=bool) if isinstance(i, np.ndarray) else False
        return costs.stage_peak(i, j, live[s], memory) <= budgets[s]

    def fits(s: int, i: Any, j: Any) -> Any:
        return plain(s, i, j) | (rc.peak(i, j, live[s], memory) <= budgets[s])

    def time(s: int, i: Any, j: Any) -> Any:
        return np.where(plain(s, i, j), costs.stage_time(i, j), rc.time(i, j))

    found = partition(costs.num_blocks, num_stages, time, fits, grid=True)
    if found is None:
        return None
    b = found.bounds
    return found, tuple(not bool(plain(s, b[s], b[s + 1])) for s in range(num_stages))


def _retell(message: str, *, helps: bool) -> str:
    """A split error without recomputation: say whether recomputation would have made it fit."""
    if helps:
        return message.replace(FIX, "activation recomputation makes it fit: pass recompute='auto' (or True); "
                                    "or " + FIX.replace("activation recomputation, ", ""))
    return message.replace(FIX, FIX_NO_RECOMPUTE + " (activation recomputation would not make it fit either)")


def _recompute_infeasible(rc: RecomputeCosts, num_stages: int, live: Sequence[int], budgets: Sequence[float],
                          memory: MemoryModel, names: Sequence[str]) -> str:
    """Like `split.infeasible_message`, for the smaller of each stage's peaks with and without recomputation."""
    def peak(s: int, i: Any, j: Any) -> Any:  # one range, or grids of index arrays
        return np.minimum(rc.costs.stage_peak(i, j, live[s], memory), rc.peak(i, j, live[s], memory))

    over = partition(rc.costs.num_blocks, num_stages, lambda s, i, j: peak(s, i, j) - budgets[s], grid=True)
    assert over is not None  # num_stages <= num_blocks was checked by the caller
    b = over.bounds
    stage = max(range(num_stages), key=lambda s: peak(s, b[s], b[s + 1]) - budgets[s])
    block = max(range(rc.costs.num_blocks), key=lambda k: rc.peak(k, k + 1, max(live), memory))
    label = f" ({names[block]})" if names else ""
    return (f"no split into {num_stages} stages fits, even with activation recomputation: stage {stage} needs at "
            f"least {nbytes(peak(stage, b[stage], b[stage + 1]))} with {live[stage]} microbatch"
            f"{'es' if live[stage] != 1 else ''} in flight, its limit is {nbytes(budgets[stage])}; the largest single "
            f"block{label} needs {nbytes(rc.peak(block, block + 1, max(live), memory))} alone when it recomputes "
            f"({nbytes(rc.costs.param_bytes[block] * memory.param_factor)} of weights, grads and optimizer "
            f"state); {FIX_NO_RECOMPUTE}")
