"""Stage costs: F/B/W seconds, bytes kept and sent, for a split, estimated from blocks or exact.

Estimates sum the blocks' numbers (cheap, used while searching). Exact costs slice the graph with
`ir.split` and time the F, B and W graphs that `ir.stage_autodiff` builds; saved bytes are what F
really hands to B and W. Exact costs are cached per equation range, since a stage's slice depends only
on its own range.
"""
from __future__ import annotations

from typing import Sequence

import attrs

import ir
import schedules

from .blocks import Blocks
from .costmodel import CostModel
from .memory import MemoryModel, StageMemory


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
    workspace_bytes: int = 0       # peak temporaries of one F, B or W (exact only)
    exact: bool = False

    @property
    def time(self) -> float:
        return self.forward + self.backward_input + self.backward_weight

    def memory(self, model: MemoryModel) -> StageMemory:
        return model.stage(param_bytes=self.param_bytes, saved_bytes=self.saved_bytes, recv_bytes=self.recv_bytes,
                           send_bytes=self.send_bytes, b_to_w_bytes=self.b_to_w_bytes,
                           workspace_bytes=self.workspace_bytes)


def _param_stats(graph: ir.Graph, params: Sequence[int]) -> tuple[int, int]:
    return (sum(graph.inputs[i].aval.nbytes for i in params), sum(graph.inputs[i].aval.numel for i in params))


def estimate(graph: ir.Graph, blocks: Blocks, bounds: Sequence[int], saved_scale: Sequence[float] | None = None) -> tuple[StageCost, ...]:
    """Stages of blocks [bounds[k], bounds[k+1]) from the blocks' sums; the first stage has no B
    (nothing upstream needs its input grad), so its backward counts as W."""
    scale = saved_scale or [1.0] * blocks.num_blocks
    out = []
    for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
        params = tuple(sorted(frozenset().union(*blocks.params[i:j])))
        nbytes, numel = _param_stats(graph, params)
        b, w = sum(blocks.backward_input[i:j]), sum(blocks.backward_weight[i:j])
        out.append(StageCost(
            start=blocks.bounds[i], stop=blocks.bounds[j], forward=sum(blocks.forward[i:j]),
            backward_input=0.0 if k == 0 else b, backward_weight=w + b if k == 0 else w,
            flops=sum(blocks.flops[i:j]), params=params, param_bytes=nbytes, num_params=numel,
            saved_bytes=int(sum(blocks.saved[x] * scale[x] for x in range(i, j))), b_to_w_bytes=0,
            recv_bytes=blocks.cut_bytes[i], send_bytes=blocks.cut_bytes[j]))
    return tuple(out)


def _slot_bytes(ad: ir.StageAD, slots: set[int]) -> int:
    return sum(ad.slot_avals[s].nbytes for s in slots)


def transient_bytes(g: ir.Graph) -> int:
    """Peak bytes of the values `g` makes and frees again (not its outputs, not views), run in order
    with each value freed after its last use, as the runtime does."""
    last, outputs = g.last_use(), set(g.outputs)
    size: dict[ir.Var, int] = {}
    live = peak = 0
    for i, e in enumerate(g.eqns):
        cost = ir.eqn_cost(e)
        for v in e.out_vars:
            if v not in outputs and v in last and (cost.flops or cost.bytes):
                size[v] = v.aval.nbytes
                live += size[v]
        peak = max(peak, live)
        for v in dict.fromkeys(e.inputs):
            if last.get(v) == i and v in size:
                live -= size.pop(v)
    return peak


def _exact_stage(graph: ir.Graph, stage: ir.Stage, model: CostModel, device: str | None) -> StageCost:
    g = stage.graph
    n_params, n_batch = len(stage.param_ids), len(stage.batch_ids)
    ad = ir.stage_autodiff(g, constant=range(n_params, n_params + n_batch), device=device)
    f, b, w = ad.forward, ad.backward_input, ad.backward_weight
    n_in = len(g.inputs)
    from_f = {s for s in (*b.in_slots, *w.in_slots) if s >= n_in and s in set(f.out_slots)}
    grads = {s for s in ad.grad_slots if s is not None}
    b_to_w = set(w.in_slots) & (set(b.out_slots) - grads)
    order = list(graph.defined())
    nbytes, numel = _param_stats(graph, stage.param_ids)
    return StageCost(
        start=stage.start, stop=stage.stop, forward=model.graph_time(f.graph),
        backward_input=model.graph_time(b.graph), backward_weight=model.graph_time(w.graph),
        flops=sum(ir.eqn_cost(e).flops for e in g.eqns), params=tuple(stage.param_ids), param_bytes=nbytes,
        num_params=numel, saved_bytes=_slot_bytes(ad, from_f), b_to_w_bytes=_slot_bytes(ad, b_to_w),
        recv_bytes=sum(order[v].aval.nbytes for v in stage.acts_in),
        send_bytes=sum(order[v].aval.nbytes for v in stage.acts_out),
        workspace_bytes=max(transient_bytes(p.graph) for p in (f, b, w)), exact=True)


def exact(graph: ir.Graph, cuts: Sequence[int], model: CostModel, *, device: str | None = None,
          cache: dict[tuple[int, int], StageCost] | None = None) -> tuple[StageCost, ...]:
    """Exact costs of the stages `ir.split(graph, cuts)`, traced through stage autodiff."""
    cache = {} if cache is None else cache
    out = []
    for stage in ir.split(graph, cuts):
        key = (stage.start, stage.stop)
        if key not in cache:
            cache[key] = _exact_stage(graph, stage, model, device)
        out.append(cache[key])
    return tuple(out)


def exact_blocks(graph: ir.Graph, blocks: Blocks, model: CostModel, *, device: str | None = None,
                 split_bw: bool = False) -> Blocks:
    """`blocks` with F/B/W seconds and saved bytes from stage autodiff of each block; blocks that print
    alike (a model's N identical layers) are differentiated once. A block's saved bytes include its
    input (inside a stage, a saved activation) and, when the schedule runs B and W apart (`split_bw`),
    what B hands to W."""
    costs: dict[str, StageCost] = {}
    per_block = []
    for stage in ir.split(graph, blocks.bounds[1:-1]):
        key = str(stage.graph)
        if key not in costs:
            costs[key] = _exact_stage(graph, stage, model, device)
        per_block.append(costs[key])
    return attrs.evolve(
        blocks, forward=tuple(c.forward for c in per_block),
        backward_input=tuple(c.backward_input for c in per_block),
        backward_weight=tuple(c.backward_weight for c in per_block),
        saved=tuple(c.saved_bytes + c.recv_bytes + (c.b_to_w_bytes if split_bw else 0) for c in per_block))


def schedule_costs(stages: Sequence[StageCost], table: schedules.Table, model: CostModel,
                   memory: MemoryModel) -> schedules.Costs:
    """The simulator's view of these stages: times, transfer bytes, and memory per rank."""
    mems = [s.memory(memory) for s in stages]
    static = tuple(sum(mems[s].static for s in table.stages_of(r)) for r in range(table.num_ranks))
    return schedules.Costs(
        forward=tuple(s.forward for s in stages), backward_input=tuple(s.backward_input for s in stages),
        backward_weight=tuple(s.backward_weight for s in stages), comm_latency=model.link.latency,
        comm_bandwidth=model.link.bandwidth, activation_bytes=tuple(float(s.send_bytes) for s in stages),
        memory_per_microbatch=tuple(m.per_microbatch for m in mems),
        memory_b_to_w=tuple(m.b_to_w for m in mems), static_memory=static)
