"""Slicing graphs: sub-graphs of equation sets, and contiguous pipeline stages with carried values."""
from __future__ import annotations

from typing import Iterable, Sequence

import attrs

from .core import Eqn, Graph, Var
from .errors import IRError


def _uses(g: Graph) -> dict[Var, list[int]]:
    uses: dict[Var, list[int]] = {}
    for i, e in enumerate(g.eqns):
        for v in dict.fromkeys(e.inputs):
            uses.setdefault(v, []).append(i)
    return uses


def slice_graph(g: Graph, eqn_indices: Iterable[int], *, outputs: Sequence[Var] | None = None) -> Graph:
    """The equations `eqn_indices` (kept in order) as a graph of their own.

    Inputs: the graph inputs they read (params first, as in `g`), then values defined outside the set
    that they read, in definition order. Outputs: `outputs` if given, else the values they define that
    an equation outside the set or the graph's outputs need.
    """
    idx = sorted(set(eqn_indices))
    inside = set(idx)
    eqns = tuple(g.eqns[i] for i in idx)
    defined = {v for e in eqns for v in e.out_vars}
    read = {v for e in eqns for v in e.inputs}
    read |= {v for v in (outputs or ()) if isinstance(v, Var) and v not in defined}
    order = list(g.defined())
    ext = [v for v in order if v in read and v not in defined]
    pos = {v: i for i, v in enumerate(g.inputs)}
    params = [v for v in ext if pos.get(v, len(g.inputs)) < g.num_params]
    rest = [v for v in ext if v not in set(params)]
    if outputs is None:
        uses = _uses(g)
        final = {v for v in g.outputs if isinstance(v, Var)}
        outputs = [v for v in order if v in defined and
                   (v in final or any(u not in inside for u in uses.get(v, ())))]
    names = dict(zip(g.inputs, g.input_names)) if g.input_names else {}
    inputs = tuple(params + rest)
    return Graph(inputs, eqns, tuple(outputs), tuple(names.get(v, "") for v in inputs), len(params))


@attrs.frozen(eq=False)
class Stage:
    """Pipeline stage k: equations [start, stop) of the model graph, as a graph of their own.

    `graph.inputs` = params it reads, batch leaves it reads, then `acts_in` (received from stage k-1);
    `graph.outputs` = `acts_out` (sent to stage k+1), then the model's outputs on the last stage.
    Value ids index `list(model.defined())`, so every rank agrees on them.
    """

    index: int
    start: int
    stop: int
    graph: Graph
    param_ids: tuple[int, ...]
    batch_ids: tuple[int, ...]
    acts_in: tuple[int, ...]
    acts_out: tuple[int, ...]
    frozen_in: tuple[int, ...] = ()   # positions k of acts_in that carry no gradient (`no_grad_values`)
    frozen_out: tuple[int, ...] = ()  # positions j of acts_out likewise: no cotangent comes back for them

    @property
    def is_last(self) -> bool:
        return len(self.graph.outputs) > len(self.acts_out)


def _check_cuts(g: Graph, cuts: Sequence[int]) -> list[int]:
    bounds = [0, *cuts, len(g.eqns)]
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise IRError(f"cuts {list(cuts)} must be strictly increasing inside (0, {len(g.eqns)})")
    return bounds


REDETACH = "fnpipe: received value detached again"


def no_grad_values(g: Graph) -> set[Var]:
    """Values no gradient flows through: batch inputs, `detach` results, and what only they and integer or bool
    values feed (a float cast of a comparison: a loss's `weight=` made from `h > 0` carries none, and
    binary_cross_entropy refuses a weight that requires grad)."""
    frozen = set(g.batch)
    for e in g.eqns:
        if e.op == "aten.detach.default" or all(v in frozen or not _differentiable(v) for v in e.inputs):
            frozen.update(e.out_vars)
    return frozen


def _differentiable(v: Var) -> bool:
    """A value a gradient can flow through: floating point or complex (an integer or bool value carries none)."""
    return v.aval.dtype.is_floating_point or v.aval.dtype.is_complex


def off_the_loss(g: Graph) -> set[Var]:
    """Values the loss's (`g.outputs[0]`) gradient does not reach: those only aux outputs read, or only through an
    integer or bool value (a comparison); their gradient is zero. A stage that receives one holds it constant and
    sends no grad back (a zeros grad would run the sender's backward of it: 0 x inf = NaN for a metric's sqrt at
    zero, where torch.func.grad gives finite grads)."""
    prod = g.producers()
    need: set[Var] = set()
    stack = [v for v in g.outputs[:1] if isinstance(v, Var)]
    while stack:
        v = stack.pop()
        if v not in need:
            need.add(v)
            if v in prod and _differentiable(v):
                stack.extend(g.eqns[prod[v]].inputs)
    return {v for e in g.eqns for v in e.out_vars if v not in need}


def _redetach(g: Graph, values: Sequence[Var]) -> Graph:
    """Detach received `values` first thing in the stage: its autodiff then sees constants, as the whole
    graph did (batch_norm refuses a running_mean that requires grad)."""
    fresh = {v: Var(v.aval) for v in values if v.aval.dtype.is_floating_point}
    if not fresh:
        return g
    head = tuple(Eqn("aten.detach.default", (v,), (), (d,), source=REDETACH) for v, d in fresh.items())
    outputs = tuple(fresh.get(v, v) if isinstance(v, Var) else v for v in g.outputs)
    return attrs.evolve(g, eqns=head + tuple(e.replace_inputs(fresh) for e in g.eqns), outputs=outputs)


def _crossings(g: Graph, bounds: Sequence[int], order: Sequence[Var]) -> tuple[list[list[Var]], list[list[Var]]]:
    """Per stage, the values it receives and the values it sends on (made before its end, read after it), in
    definition order. One pass over the values: O(values + crossings), whatever the number of stages."""
    n = len(bounds) - 1
    stage_of_eqn = [k for k in range(n) for _ in range(bounds[k], bounds[k + 1])]
    last_stage_use: dict[Var, int] = {}
    for i, e in enumerate(g.eqns):
        for v in e.inputs:
            last_stage_use[v] = stage_of_eqn[i]
    for v in g.outputs:
        if isinstance(v, Var):
            last_stage_use[v] = n
    prod = g.producers()
    into: list[list[Var]] = [[] for _ in range(n)]
    out: list[list[Var]] = [[] for _ in range(n)]
    for v in order:
        if v not in prod:
            continue
        first, last = stage_of_eqn[prod[v]], last_stage_use.get(v, -1)
        for k in range(first + 1, min(last, n - 1) + 1):
            into[k].append(v)
        for k in range(first, min(last, n - 1)):
            out[k].append(v)
    return into, out


def split(g: Graph, cuts: Sequence[int]) -> tuple[Stage, ...]:
    """Cut `g` before each equation index in `cuts`; a value used by a later stage is carried through
    the stages between, so each stage talks only to its neighbours. A received value that carries no
    gradient in `g` (see `no_grad_values`: RoPE's cos and sin tables, masks made from the batch; and
    `off_the_loss`: an aux metric's values) is detached
    again in the receiving stage, and both stages name it (`frozen_in`, `frozen_out`) so that stage autodiff
    neither computes nor sends a gradient for it. Linear in the graph
    size plus what crosses the cuts (a 70 B model's 128-block graphs are split thousands of times)."""
    bounds = _check_cuts(g, cuts)
    frozen = no_grad_values(g) | off_the_loss(g)
    order = list(g.defined())
    vid = {v: i for i, v in enumerate(order)}
    n = len(bounds) - 1
    into, out = _crossings(g, bounds, order)
    inputs_pos = {v: i for i, v in enumerate(g.inputs)}
    names = dict(zip(g.inputs, g.input_names)) if g.input_names else {}
    stages = []
    for k in range(n):
        crossing_in, crossing_out = into[k], out[k]
        eqns = g.eqns[bounds[k]:bounds[k + 1]]
        read = {v for e in eqns for v in e.inputs}
        params = [v for v in g.params if v in read]
        batch = [v for v in g.batch if v in read]
        outs = crossing_out + ([v for v in g.outputs] if k == n - 1 else [])
        inputs = tuple(params + batch + crossing_in)
        graph = Graph(inputs, tuple(eqns), tuple(outs), tuple(names.get(v, f"%{vid[v]}") for v in inputs), len(params))
        graph = _redetach(graph, [v for v in crossing_in if v in frozen])
        stages.append(Stage(k, bounds[k], bounds[k + 1], graph,
                            tuple(inputs_pos[v] for v in params), tuple(inputs_pos[v] for v in batch),
                            tuple(vid[v] for v in crossing_in), tuple(vid[v] for v in crossing_out),
                            tuple(i for i, v in enumerate(crossing_in) if v in frozen),
                            tuple(j for j, v in enumerate(crossing_out) if v in frozen)))
    return tuple(stages)
