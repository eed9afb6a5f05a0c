"""Evaluation on the training plan: `step.evaluate(params, *inputs)` runs a forward-only program on the same
stages, ranks, replicas and microbatch count, and returns the outputs (logits), not a loss.

    step = engine.parallelize(fn, variables, x, y, has_aux=True)      # fn from engine.functionalize
    logits = step.evaluate(variables, x_val)                          # the module in eval mode, every rank

What runs: the eval function (`forward(params, *inputs) -> outputs`, each output leaf with the batch along
dim 0; `engine.functionalize` attaches the module's eval-mode forward as `fn.forward`, so BatchNorm uses its
running statistics and dropout is off) is traced once per input shape at the plan's microbatch size. Its
graph is cut where the training graph was cut, as the parameters say: an equation that reads a parameter
runs on the stage that holds it for training (`eval_cuts`), so no parameter moves and nothing is planned
again; the plan cache entry of the training plan is the only one (evaluation derives its cuts from it
every time, deterministically on every rank). Each rank runs its stages' forward graphs microbatch by
microbatch, in (microbatch, stage) order, receiving activations from the previous stage's rank and
sending to the next over the training step's channels: the earliest unfinished (microbatch, stage) can
always run, so the order cannot deadlock (GPipe's forward). Each dp replica evaluates its share of the batch,
and inside one a position replicated k times (`plan.replicas`) runs microbatch i on its replica i mod k, as
training routes it (`routing.world_rank`): activations go to the rank that owns the microbatch at the next
position, over the channels training made for it.

`gather` says who gets the outputs: "all" (default) every rank, the full batch in order (one sum over all
ranks of zero-padded outputs: meant for logits, not for activations of a whole batch); "local" the
ranks of the last stage, the rows of the microbatches each ran, in batch order; None on the others.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

import ir

from ..errors import PlanError, RuntimeMismatchError
from ..planning.artifacts import StageInfo
from ..planning.plan import fingerprint
from ir.device import rank_neutral

from . import routing

__all__ = ["GATHER", "Evaluator", "eval_cuts"]

GATHER = ("all", "local")
_TRACING = threading.Lock()


def owners(train: Sequence[StageInfo]) -> dict[int, int]:
    """Each param id -> the first training stage that reads it."""
    owner: dict[int, int] = {}
    for info in train:
        for pid in info.stage.param_ids:
            owner.setdefault(pid, info.stage.index)
    return owner


def eval_cuts(train: Sequence[StageInfo], graph: ir.Graph) -> tuple[int, ...]:
    """Cuts of the eval `graph` such that every equation reading a parameter sits in the training stage
    that reads it (the latest, for one that reads params of two: a layer the training plan cut inside, such
    as BatchNorm's statistics before a cut and its normalisation after). PlanError when none exist."""
    owner = owners(train)
    reads = _param_reads(graph)
    fixed = [(i, max(owner.get(p, 0) for p in ps)) for i, ps in enumerate(reads) if ps]
    n, cuts = len(graph.eqns), []
    for k in range(1, len(train)):
        lower = max([i + 1 for i, s in fixed if s < k] or [1])
        upper = min([i for i, s in fixed if s >= k] or [n - (len(train) - k)])
        cut = max(upper, (cuts[-1] + 1) if cuts else 1)
        if cut < lower or cut > n - (len(train) - k):
            raise PlanError(f"the eval function cannot run on the training plan's stages: its equations that read "
                            f"the params of stage {k - 1} and of stage {k} interleave (equations {lower - 1} and "
                            f"{upper}); evaluate a function that uses the params in the order training does")
        cuts.append(cut)
    return tuple(cuts)


def _param_reads(graph: ir.Graph) -> list[frozenset[int]]:
    """Per equation, the params it reads: directly, or through equations that read only params (a buffer's
    detach before its batch_norm: `ir.sink` places those next to their consumer, so they are one op)."""
    pid_of = {v: i for i, v in enumerate(graph.inputs[:graph.num_params])}
    via: dict[ir.Var, frozenset[int]] = {}  # outputs of param-only equations -> the params behind them
    out = []
    for e in graph.eqns:
        ps = frozenset().union(*[{pid_of[v]} if v in pid_of else via.get(v, frozenset()) for v in e.inputs])
        if all(v in pid_of or v in via for v in e.inputs):
            via.update((v, ps) for v in e.out_vars)
        out.append(ps)
    return out


def lent(train: Sequence[StageInfo], stages: Sequence[ir.Stage], rank_of: Callable[[int], int],
         holds: Callable[[int], set[int]], names: Sequence[str]) -> list[tuple[int, int, int]]:
    """(param id, from pipeline position, to position): params an eval stage reads that its position does not
    hold for training, each sent by the position of the training stage that reads it (a neighbour) at every
    evaluate. `holds(q)`: the params position q holds."""
    owner, out = owners(train), []
    for st in stages:
        dst = rank_of(st.index)
        for pid in sorted(set(st.param_ids) - holds(dst)):
            src = rank_of(owner[pid]) if pid in owner else None
            if src is None or abs(owner[pid] - st.index) != 1:
                raise PlanError(f"the eval function reads '{names[pid]}' on stage {st.index}, but the training plan "
                                "holds it elsewhere; evaluate a function that uses the params where the loss "
                                "function does")
            out.append((pid, src, dst))
    return out


class Evaluator:
    """The forward-only program of one eval function and input shapes on one rank (built once, kept)."""

    def __init__(self, step: Any, forward: Callable, params: Any, inputs: Sequence[Any]) -> None:
        self.step, plan = step, step.plan
        self.m, self.dp, self.p = plan.microbatches, plan.dp, plan.pipeline_depth
        leaves, tree = pytree.tree_flatten(params, is_leaf=lambda x: x is None)
        g = step.graph
        specs = [ir.TensorSpec(tuple(g.inputs[i].aval.shape), g.inputs[i].aval.dtype, step.world.device.type)
                 for i in range(len(leaves))]
        rows = _rows(inputs, self.m * self.dp)
        batch = pytree.tree_map(lambda x: ir.TensorSpec((rows, *x.shape[1:]), x.dtype, step.world.device.type),
                                tuple(inputs))
        with _TRACING:  # make_fx is not thread-safe; in-process ranks are threads
            self.graph = ir.trace(forward, pytree.tree_unflatten(specs, tree), *batch, device=step.world.device.type)
        holders, plan = step.holders(), step.plan
        held = lambda q: {pid for pid, ranks in holders.items()  # noqa: E731  (position q's first rank of dp replica 0)
                          if routing.world_rank(plan, 0, q, 0) in ranks}
        self.mine = frozenset(step.microbatches)  # of the dp replica's microbatches, those this rank runs
        self.replica_of_position = routing.place(plan, step.world.rank).replica
        self.cuts = eval_cuts(step.infos, self.graph)
        self.stages = ir.split(self.graph, self.cuts)
        self.lent = lent(step.infos, self.stages, step.table.rank_of, held, g.input_names)
        self.programs = {s: ir.compile_graph(self.stages[s].graph, ()) for s in step.local_stages}
        for s, st in enumerate(self.stages):
            if st.is_last:
                bad = [o.aval for o in st.graph.outputs[len(st.acts_out):] if not o.aval.shape or o.aval.shape[0] != rows]
                if bad:
                    raise PlanError(f"evaluate returns each output cut along dim 0 by microbatch ({rows} rows); the "
                                    f"eval function returns {bad}: return per-example outputs (logits), not a mean")

    def verify(self) -> None:
        """Every rank traced and cut the same eval program (a collective: the first evaluate on each rank)."""
        mine = fingerprint([rank_neutral(str(self.graph)), list(self.cuts)])
        prints = self.step.transport.all_gather_json([mine])
        if any(p[0] != prints[0][0] for p in prints):
            raise RuntimeMismatchError(f"the ranks built different eval programs ({[p[0][:12] for p in prints]}); "
                                       "every rank must call step.evaluate with the same function and shapes")

    def __call__(self, params: Any, inputs: Sequence[Any], gather: str) -> Any:
        step = self.step
        leaves = pytree.tree_leaves(params, is_leaf=lambda x: x is None)
        chunks = _split(inputs, self.m * self.dp)[step.replica * self.m:(step.replica + 1) * self.m]
        outs: list[list[torch.Tensor]] = []
        sends: list[Any] = []
        leaves = self._borrow(leaves, sends)
        with torch.no_grad():
            for mb, chunk in enumerate(chunks):
                if mb not in self.mine:
                    continue
                acts: dict[int, list[torch.Tensor]] = {}
                for s in step.local_stages:
                    got = self._stage(s, mb, leaves, chunk, acts.pop(s, None), sends)
                    if self.stages[s].is_last:
                        outs.append((mb, got))
                    elif step.table.rank_of(s + 1) == step.position:
                        acts[s + 1] = got
        for work, _ in sends:
            step.transport.wait(work, "sending an activation (evaluate)")
        return self._gathered(outs, inputs, gather)

    def _borrow(self, leaves: list[Any], sends: list[Any]) -> list[Any]:
        """Params this rank's eval stages read but training holds on a neighbouring position: replica k of the
        receiving position gets them from the rank that runs microbatch k at the sending one (a pair training
        sends that microbatch's activations or grads over)."""
        step, leaves = self.step, list(leaves)
        counts = step.plan.replicas
        ops = [("send", self._owner(dst, k), leaves[pid].contiguous()) for pid, src, dst in self.lent
               if src == step.position and dst != step.position
               for k in range(counts[dst]) if self._owner(src, k) == step.world.rank]
        sends += zip(step.transport.post(ops), [t for _, _, t in ops])
        for pid, src, dst in self.lent:
            if dst == step.position and src != step.position:
                aval = self.graph.inputs[pid].aval
                leaves[pid] = torch.empty(aval.shape, dtype=aval.dtype, device=step.world.device)
                peer = self._owner(src, self.replica_of_position)
                step.transport.wait(step.transport.post([("recv", peer, leaves[pid])])[0], "receiving a param")
        return leaves

    def _owner(self, position: int, mb: int) -> int:
        """The world rank of this dp replica that runs microbatch `mb` at pipeline `position`."""
        return routing.world_rank(self.step.plan, self.step.replica, position, mb)

    def _stage(self, s: int, mb: int, leaves: list[Any], chunk: list[torch.Tensor],
               acts: list[torch.Tensor] | None, sends: list[Any]) -> list[torch.Tensor]:
        st, step, n, rank_of = self.stages[s], self.step, self.graph.num_params, self.step.table.rank_of
        if acts is None and st.acts_in:  # from the rank that ran this microbatch at the previous stage
            avals = [st.graph.inputs[len(st.param_ids) + len(st.batch_ids) + k].aval for k in range(len(st.acts_in))]
            acts = [torch.empty(a.shape, dtype=a.dtype, device=step.world.device) for a in avals]
            peer = self._owner(rank_of(s - 1), mb)
            for h, t in zip(step.transport.post([("recv", peer, t) for t in acts]), acts):
                step.transport.wait(h, f"receiving stage {s}'s input (evaluate)")
        args = [leaves[p] for p in st.param_ids] + [chunk[b - n].to(step.world.device) for b in st.batch_ids]
        outs = list(self.programs[s](*args, *(acts or [])))
        sent = outs[:len(st.acts_out)]
        if not st.is_last and rank_of(s + 1) != step.position:
            ops = [("send", self._owner(rank_of(s + 1), mb), t.contiguous()) for t in sent]
            sends += zip(step.transport.post(ops), [t for _, _, t in ops])  # each tensor kept until sent
        return outs[len(st.acts_out):] if st.is_last else sent

    def _gathered(self, outs: list[tuple[int, list[torch.Tensor]]], inputs: Sequence[Any], gather: str) -> Any:
        step, tree = self.step, self.graph.out_tree
        rows = _rows(inputs, 1)
        last = self.stages[-1]
        if gather == "local":
            local = [torch.cat(parts) for parts in zip(*(got for _, got in outs))] if outs else None
            return None if local is None else pytree.tree_unflatten(local, tree)
        full = []
        each = rows // (self.dp * self.m)  # rows of one microbatch
        for k, v in enumerate(last.graph.outputs[len(last.acts_out):]):
            buf = torch.zeros((rows, *v.aval.shape[1:]), dtype=v.aval.dtype, device=step.world.device)
            for mb, got in outs:  # each microbatch's rows where the batch had them: one rank writes each
                first = (step.replica * self.m + mb) * each
                buf[first:first + each] = got[k]
            if step.world.size > 1:
                step.transport.all_reduce(buf, tuple(range(step.world.size)))
            full.append(buf)
        return pytree.tree_unflatten(full, tree)


def _rows(inputs: Sequence[Any], parts: int) -> int:
    leaves = pytree.tree_leaves(tuple(inputs))
    if not leaves or any(not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % parts for x in leaves):
        sizes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in leaves]
        raise PlanError(f"evaluate cuts every input along dim 0 into microbatches x dp = {parts} equal parts; got "
                        f"inputs {sizes}: pass a batch whose size {parts} divides")
    return int(leaves[0].shape[0]) // parts


def _split(inputs: Sequence[Any], parts: int) -> list[list[torch.Tensor]]:
    leaves = pytree.tree_leaves(tuple(inputs))
    cut = [torch.tensor_split(x, parts, dim=0) for x in leaves]
    return [[c[k] for c in cut] for k in range(parts)]
