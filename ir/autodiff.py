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


def _remat_views(g: Graph, part: set[int], before: set[int], avail: set[Var]) -> set[int]:
    """Add to `part` the view equations of earlier parts whose operands are at hand, so that a view of
    a saved value or an input is recomputed (free) instead of saved as another tensor."""
    prod = g.producers()
    changed = True
    while changed:
        changed = False
        for i in sorted(part):
            for v in g.eqns[i].inputs:
                j = prod.get(v)
                if j is None or j in part or j not in before:
                    continue
                e = g.eqns[j]
                if is_view(resolve(e.op)) and all(x in avail or prod.get(x) in part for x in e.inputs):
                    part.add(j)
                    changed = True
    return part


def _part(g: Graph, idx: set[int], slot: dict[Var, int], outputs: list[Var]) -> Part:
    sub = slice_graph(g, idx, outputs=outputs)
    return Part(sub, tuple(slot[v] for v in sub.inputs), tuple(slot[v] for v in outputs))


def _needed_from(g: Graph, consumers: set[int], producers: set[int], outputs: Sequence[Any] = ()) -> list[Var]:
    """Values that the eqns `consumers` read, or return as `outputs`, and that `producers` define."""
    prod = g.producers()
    need = {v for i in consumers for v in g.eqns[i].inputs if prod.get(v) in producers}
    need |= {v for v in outputs if isinstance(v, Var) and prod.get(v) in producers}
    return [v for v in g.defined() if v in need]


def stage_autodiff(g: Graph, *, constant: Sequence[int] = (), device: str | None = None) -> StageAD:
    """Forward / B / W graphs for a stage graph `g` (see StageAD). B differentiates the non-param
    float inputs except those in `constant` (batch leaves), W the float params (the first
    `g.num_params` inputs). `device` overrides the graph's device for tracing."""
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
    b_own = _ancestors(jg, act_grads, f_idx)
    w_own = _ancestors(jg, param_grads, f_idx | b_own)
    prim = set(jg.inputs)
    # B and W keep the view eqns they recompute (they may also be in F): a view is free, saving it is not.
    b_idx = _remat_views(jg, set(b_own), f_idx, prim)
    w_idx = _remat_views(jg, set(w_own), f_idx | b_own, prim)
    slot = {v: i for i, v in enumerate(jg.inputs)}
    # A multi-output backward op (native_layer_norm_backward) in B may define W's param grads too.
    saved = {*_needed_from(jg, b_idx, f_idx - b_idx, act_grads),
             *_needed_from(jg, w_idx, f_idx - w_idx, param_grads)}
    saved_f = [v for v in jg.defined() if v in saved]
    stash_b = _needed_from(jg, w_idx, b_own - w_idx, param_grads)
    out_vars = [v for v in outs if isinstance(v, Var)]
    for v in [*out_vars, *saved_f, *stash_b, *[x for x in grads if isinstance(x, Var)]]:
        slot.setdefault(v, len(slot))
    fwd = _part(jg, f_idx, slot, list(dict.fromkeys(out_vars + saved_f)))
    bwd = _part(jg, b_idx, slot, list(dict.fromkeys(act_grads + stash_b)))
    wgt = _part(jg, w_idx, slot, param_grads)
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
