"""Stage autodiff: forward, B (grads of activation inputs) and W (grads of params) as separate graphs.

The joint `outputs, vjp(cotangents)` of a stage is traced once at ATen level; its equations are split by
ancestry: F computes the outputs, B what the input grads need beyond F, W the rest. No equation runs
in both B and W; every value one part hands to a later one is an explicit slot.
"""
from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from .compile import compile_graph
from .core import Eqn, Graph, Var
from .fx_import import FxImporter
from .purify import is_view, remove_mutation, resolve
from .slicing import slice_graph


@attrs.frozen
class Part:
    """One of F, B, W: a graph and where its inputs come from and its outputs go (slot numbers)."""

    graph: Graph
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]


@attrs.frozen(eq=False)
class StageAD:
    """F/B/W programs of a stage graph over numbered slots.

    Slots: [0, n_in) the stage graph's inputs; then one per output cotangent (`ct_slots`, float
    outputs only); then saved values. `out_slots` are the stage outputs, `grad_slots[i]` the grad of
    input i (None if i is not differentiable), all written by F, B or W.
    """

    forward: Part
    backward_input: Part
    backward_weight: Part
    num_slots: int
    out_slots: tuple[int, ...]
    ct_slots: tuple[int | None, ...]
    grad_slots: tuple[int | None, ...]
    slot_avals: tuple[Any, ...]

    def saved_bytes(self) -> int:
        """Bytes F keeps for B and W beyond the stage's inputs and outputs (per microbatch)."""
        keep = set(self.forward.out_slots) - set(self.out_slots)
        return sum(self.slot_avals[s].nbytes for s in keep)


def _differentiable(v: Var) -> bool:
    return v.aval.dtype.is_floating_point or v.aval.dtype.is_complex


def _trace_joint(g: Graph, diff_in: list[int], diff_out: list[int], device: str | None) -> Graph:
    run = compile_graph(g)
    n_in = len(g.inputs)

    def joint(*xs: Any) -> tuple[Any, ...]:
        ins, cts = list(xs[:n_in]), xs[n_in:]

        def f(*d: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            full = list(ins)
            for i, x in zip(diff_in, d):
                full[i] = x
            outs = run(*full)
            return tuple(outs[j] for j in diff_out), tuple(outs)

        _, vjp, outs = torch.func.vjp(f, *[ins[i] for i in diff_in], has_aux=True)
        return (*outs, *vjp(tuple(cts)))

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    dev = lambda v: device or v.aval.device  # noqa: E731
    with mode:
        fake = [torch.empty(v.aval.shape, dtype=v.aval.dtype, device=dev(v)) for v in g.inputs]
        fake += [torch.empty(g.outputs[j].aval.shape, dtype=g.outputs[j].aval.dtype, device=dev(g.outputs[j]))
                 for j in diff_out]
        gm = make_fx(joint, tracing_mode="fake")(*fake)
    imp = FxImporter(gm).run()
    jg = Graph(tuple(imp.inputs), tuple(imp.eqns), imp.outputs, num_params=0)
    return remove_mutation(attrs.evolve(jg, input_names=tuple(f"in{i}" for i in range(len(jg.inputs)))))


def _ancestors(g: Graph, targets: Sequence[Any], exclude: set[int]) -> set[int]:
    prod = g.producers()
    seen: set[int] = set()
    stack = [prod[v] for v in targets if isinstance(v, Var) and v in prod]
    while stack:
        i = stack.pop()
        if i in seen or i in exclude:
            continue
        seen.add(i)
        stack.extend(prod[v] for v in g.eqns[i].inputs if v in prod)
    return seen


CHEAP = frozenset({"aten.native_layer_norm.default"})  # memory-bound, recomputed from saved inputs


def recomputable(e: Eqn) -> bool:
    """Cheap to redo in the backward instead of saving: views, pointwise ops, layer norm."""
    op = resolve(e.op)
    return is_view(op) or torch.Tag.pointwise in op.tags or e.op in CHEAP


def _rematerialize(g: Graph, f: set[int], b: set[int], w: set[int]) -> tuple[set[int], set[int]]:
    """F equations to recompute in B (`rb`) and in W (`rw`) instead of saving their outputs.

    A cheap equation (view, pointwise, layer norm) is recomputed where its output is needed when every
    operand is at hand there anyway (an input, a value that part computes, or a value saved for it), so
    the saved bytes only fall. A value both B and W need is recomputed in B and handed to W, so no
    equation runs in both B and W.
    """
    prod, prim = g.producers(), set(g.inputs)
    rb: set[int] = set()
    rw: set[int] = set()
    for _ in range(8):  # a fixed point: each pass may make further operands available
        saved = _saved(g, f, _reads(g, b | rb), _reads(g, w | rw), rb, rw)
        grown = False
        for part, remat, other in ((b, rb, set()), (w, rw, rb)):
            for v in _reads(g, part | remat):
                j = prod.get(v)
                if j is None or j not in f or j in remat or j in other or not recomputable(g.eqns[j]):
                    continue
                if all(x in prim or x in saved or prod.get(x) in part | remat | other for x in g.eqns[j].inputs):
                    remat.add(j)
                    grown = True
        if not grown:
            break
    return rb, rw


def _recompute_all(g: Graph, f: set[int], b: set[int], w: set[int]) -> tuple[set[int], set[int]]:
    """Every F equation that B or W depends on is redone in B (W takes what it needs from B)."""
    needed = {v for v in _reads(g, b | w) if g.producers().get(v) in f}
    return _ancestors(g, list(needed), set()) & f, set()


def _reads(g: Graph, idx: set[int]) -> set[Var]:
    return {v for i in idx for v in g.eqns[i].inputs}


def _saved(g: Graph, f: set[int], b_need: set[Var], w_need: set[Var], rb: set[int], rw: set[int]) -> set[Var]:
    """Values F must hand on: read (or returned) by B or W, made by an F equation the reader does not redo."""
    prod = g.producers()
    return {v for v in b_need if prod.get(v) in f - rb} | {v for v in w_need if prod.get(v) in f - rw - rb}


def _needs(g: Graph, part: set[int], outputs: Sequence[Any]) -> set[Var]:
    """What a part reads, plus outputs it returns without computing them."""
    prod = g.producers()
    return _reads(g, part) | {v for v in outputs if isinstance(v, Var) and prod.get(v) not in part}


def _part(g: Graph, idx: set[int], slot: dict[Var, int], outputs: list[Var]) -> Part:
    sub = slice_graph(g, idx, outputs=outputs)
    return Part(sub, tuple(slot[v] for v in sub.inputs), tuple(slot[v] for v in outputs))


def stage_autodiff(g: Graph, *, constant: Sequence[int] = (), device: str | None = None,
                   recompute: bool = False) -> StageAD:
    """Forward / B / W graphs for a stage graph `g` (see StageAD). B differentiates the non-param
    float inputs except those in `constant` (batch leaves), W the float params (the first
    `g.num_params` inputs). `device` overrides the graph's device for tracing.

    `recompute=True` is activation recomputation: F keeps nothing but the stage's outputs, and B
    redoes the forward work that B and W need (from the stage's inputs) before differentiating.
    """
    n_in = len(g.inputs)
    skip = set(constant)
    diff_in = [i for i, v in enumerate(g.inputs) if _differentiable(v) and i not in skip]
    diff_out = [j for j, v in enumerate(g.outputs) if isinstance(v, Var) and _differentiable(v)]
    jg = _trace_joint(g, diff_in, diff_out, device)
    outs = list(jg.outputs[: len(g.outputs)])
    grads = list(jg.outputs[len(g.outputs):])
    act_grads = [x for i, x in zip(diff_in, grads) if i >= g.num_params]
    param_grads = [x for i, x in zip(diff_in, grads) if i < g.num_params]
    f_idx = _ancestors(jg, outs, set())
    b_idx = _ancestors(jg, act_grads, f_idx)
    w_idx = _ancestors(jg, param_grads, f_idx | b_idx)
    rb, rw = _recompute_all(jg, f_idx, b_idx, w_idx) if recompute else _rematerialize(jg, f_idx, b_idx, w_idx)
    b_part, w_part = b_idx | rb, w_idx | rw
    prod = jg.producers()
    slot = {v: i for i, v in enumerate(jg.inputs)}
    order = list(jg.defined())
    b_need, w_need = _needs(jg, b_part, act_grads), _needs(jg, w_part, param_grads)
    saved = _saved(jg, f_idx, b_need, w_need, rb, rw)
    saved_f = [v for v in order if v in saved]
    stash = {v for v in w_need if prod.get(v) in b_part and prod.get(v) not in w_part}
    stash_b = [v for v in order if v in stash]
    out_vars = [v for v in outs if isinstance(v, Var)]
    for v in [*out_vars, *saved_f, *stash_b, *[x for x in grads if isinstance(x, Var)]]:
        slot.setdefault(v, len(slot))
    fwd = _part(jg, f_idx, slot, list(dict.fromkeys(out_vars + saved_f)))
    bwd = _part(jg, b_part, slot, list(dict.fromkeys(act_grads + stash_b)))
    wgt = _part(jg, w_part, slot, param_grads)
    grad_slots: list[int | None] = [None] * n_in
    for i, x in zip(diff_in, grads):
        grad_slots[i] = slot[x]
    ct_slots: list[int | None] = [None] * len(g.outputs)
    for k, j in enumerate(diff_out):
        ct_slots[j] = n_in + k
    avals = [None] * len(slot)
    for v, s in slot.items():
        avals[s] = v.aval
    return StageAD(fwd, bwd, wgt, len(slot), tuple(slot[v] for v in outs), tuple(ct_slots),
                   tuple(grad_slots), tuple(avals))
