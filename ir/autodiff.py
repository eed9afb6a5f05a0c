"""Stage autodiff: forward, B (grads of activation inputs) and W (grads of params) as separate graphs,
and B + W fused into one backward for schedules that run them together.

The joint `outputs, vjp(cotangents)` of a stage is traced once at ATen level; its equations are split by
ancestry: F computes the outputs, B what the input grads need beyond F, W the rest. No equation runs
in both B and W; every value one part hands to a later one is an explicit slot.

What F saves for the backward is a choice with three levels (`recompute`), made per stage by the planner:
False saves every value B and W read (views are rebuilt from their base: free, no kernel), so the
backward runs exactly eager autograd's kernels; "cheap" rebuilds norms, copies and pointwise chains from
operands at hand instead of saving them (less memory, extra memory-bound kernels); True keeps only the
stage's outputs and B redoes the forward (activation recomputation).
"""
from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import AbstractSet, Any

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from .compile import compile_graph
from .core import AbstractValue, Eqn, Graph, Literal, Var
from .device import available, device_type, retarget
from .errors import IRError
from .fx_import import FxImporter
from .liveness import held_bytes, output_storage
from .printer import program_digest
from .purify import is_view, remove_mutation, resolve
from .slicing import slice_graph
from .static_fill import masked_fills


@attrs.frozen
class Part:
    """One of F, B, W or BW (B and W fused): a graph and where its inputs come from and its outputs go
    (slot numbers)."""

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
    backward: Part  # B and W as one program, in autograd's order: what B hands W dies where W reads it

    def saved_bytes(self) -> int:
        """Bytes F keeps for B and W beyond the stage's inputs and outputs (per microbatch)."""
        return self.slot_bytes(set(self.forward.out_slots) - set(self.out_slots))

    def slot_bytes(self, slots: AbstractSet[int]) -> int:
        """Bytes of the values in `slots`, each allocation once: outputs of F that are views of one value F made
        (a Linear's `view(x, [b*t, d])` made per matmul reading x, each saved for its weight grad: Llama's wq,
        wk and wv) share its storage (`output_storage`), as the runtime holds them; any other slot at its size."""
        stores = dict(zip(self.forward.out_slots, output_storage(self.forward.graph)))
        seen: set[int] = set()
        total = 0
        for s in slots:
            store = stores.get(s)
            if store is None:
                total += self.slot_avals[s].nbytes
            elif store[0] not in seen:
                seen.add(store[0])
                total += store[1]
        return total


def _differentiable(v: Var) -> bool:
    return v.aval.dtype.is_floating_point or v.aval.dtype.is_complex


def _trace_joint(g: Graph, diff_in: list[int], diff_out: list[int], device: str | None) -> Graph:
    """The joint graph, traced on `device` (default: the graph's). Autograd needs the device's runtime
    even on fake tensors (a CPU-only torch aborts the process on a cuda one), so for a device this
    machine lacks the joint is traced on the CPU and re-targeted: the same program, with CPU kernels
    where the device would choose its own (good for planning; running needs a trace on the device)."""
    target = device or (g.inputs[0].aval.device if g.inputs else "cpu")
    kind = device_type(target)
    if available(target):
        return _trace_joint_on(g, diff_in, diff_out, device)
    here = retarget(g, kind, "cpu")
    return retarget(_trace_joint_on(here, diff_in, diff_out, "cpu"), "cpu", target)


def _trace_joint_on(g: Graph, diff_in: list[int], diff_out: list[int], device: str | None) -> Graph:
    run = compile_graph(masked_fills(g))  # index_fill by a tensor: a backward of static shapes
    n_in = len(g.inputs)

    def joint(*xs: Any) -> tuple[Any, ...]:
        ins, cts = list(xs[:n_in]), xs[n_in:]
        if not diff_in or not diff_out:  # nothing to differentiate, or nothing to differentiate through:
            return (*run(*ins), *[torch.zeros_like(ins[i]) for i in diff_in])  # vjp refuses both

        return _vjp(run, ins, cts, diff_in, diff_out)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    dev = lambda v: device or v.aval.device
    with mode:
        fake = [torch.empty(v.aval.shape, dtype=v.aval.dtype, device=dev(v)) for v in g.inputs]
        fake += [torch.empty(g.outputs[j].aval.shape, dtype=g.outputs[j].aval.dtype, device=dev(g.outputs[j]))
                 for j in diff_out]
        gm = make_fx(joint, tracing_mode="fake")(*fake)
        if _writes(gm):
            # backward formulas that write into fresh buffers (the FFTs' and decompositions' `copy_` into a
            # view): PyTorch's functionalization makes them pure, as the forward's trace is. It runs on the
            # traced joint, not around autograd: functionalize is a functorch transform, which autograd.grad
            # (requires_grad_) may not run inside.
            gm = make_fx(torch.func.functionalize(gm), tracing_mode="fake")(*fake)
        gm.graph.eliminate_dead_code()
    imp = FxImporter(gm).run()
    jg = Graph(tuple(imp.inputs), tuple(imp.eqns), imp.outputs, num_params=0)
    jg = _without_detach(jg)
    return remove_mutation(attrs.evolve(jg, input_names=tuple(f"in{i}" for i in range(len(jg.inputs)))))


def _writes(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph has an op that writes into one of its arguments."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and any(
                a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return True
    return False


def _without_detach(g: Graph) -> Graph:
    """`g` with its `detach`es read through: autograd records one per saved tensor, and once the joint is
    traced they mean nothing (no autograd runs the stage programs) but a call each."""
    rename: dict[Var, Var] = {}
    eqns = []
    for e in g.eqns:
        e = e.replace_inputs(rename)
        if e.op == "aten.detach.default" and e.args and isinstance(e.args[0], Var):  # not a constant's
            rename[e.outputs[0]] = e.args[0]
        else:
            eqns.append(e)
    outputs = tuple(rename.get(v, v) if isinstance(v, Var) else v for v in g.outputs)
    return attrs.evolve(g, eqns=tuple(eqns), outputs=outputs)


def _vjp(run: Callable[..., Any], ins: list[Any], cts: Sequence[Any], diff_in: list[int],
         diff_out: list[int]) -> tuple[Any, ...]:
    """`(*outputs, *grads of the diff_in inputs)` through `torch.autograd.grad`, as eager autograd runs it.

    Not `torch.func.vjp`: functorch's grad transform decomposes some backward formulas into pointwise
    chains (`silu_backward` into sigmoid, fill, sub, add, mul), extra memory-bound kernels that eager
    training does not run (torch.func.grad is 1.36x eager on the Llama benchmark, H200, 2026-11-23)."""
    full = list(ins)
    leaves = []
    for i in diff_in:
        full[i] = ins[i].detach().requires_grad_(True)
        leaves.append(full[i])
    with torch.enable_grad():
        outs = run(*full)
    pairs = [(outs[j], c) for j, c in zip(diff_out, cts) if outs[j].requires_grad]
    grads: Sequence[Any] = [None] * len(leaves)
    if pairs:
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    return (*[o.detach() if isinstance(o, torch.Tensor) else o for o in outs], *grads)


def _joint(g: Graph, diff_in: list[int], diff_out: list[int], device: str | None,
           joints: MutableMapping[Any, Graph] | None) -> Graph:
    """`_trace_joint`, through the cache `joints` when one is given."""
    if joints is None:
        return _trace_joint(g, diff_in, diff_out, device)
    key = joint_key(g, diff_in, diff_out, device)
    found = joints.get(key)
    if found is None:  # (a shared cache may keep it for a while only, or not at all)
        found = joints[key] = _trace_joint(g, diff_in, diff_out, device)
    return found


def _own_grads(jg: Graph, n_outputs: int) -> Graph:
    """The joint graph with every grad output a value of its own. Autodiff may return one value as the
    grad of several inputs (`x + p` of equal shapes: both grads are the cotangent), or an input itself
    (a cotangent passed through); each such grad after the first, and each that is an input, becomes an
    alias (a view: no copy), so every grad has its own slot and a param's is added into its accumulator
    while an activation's is sent on. A constant output (a Literal) becomes a value too (a clone)."""
    outputs, extra, seen = list(jg.outputs), [], set(jg.inputs)
    for k, v in enumerate(outputs):  # a constant result (a mask the stage hands on) still needs a slot
        if isinstance(v, Literal) and isinstance(v.value, torch.Tensor):
            outputs[k] = Var(AbstractValue.of(v.value))
            extra.append(Eqn("aten.clone.default", (v,), (), (outputs[k],)))
    for k in range(n_outputs, len(outputs)):
        v = outputs[k]
        if isinstance(v, Var) and v in seen:
            fresh = Var(v.aval)
            extra.append(Eqn("aten.alias.default", (v,), (), (fresh,)))
            outputs[k] = fresh
        seen.add(outputs[k])
    return attrs.evolve(jg, eqns=jg.eqns + tuple(extra), outputs=tuple(outputs)) if extra else jg


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


# Memory-bound ops recomputed from saved inputs rather than saved: norms and copies. (Softmaxes are not:
# an LM head's log-softmax over the vocabulary is as costly to redo as a matmul is to save.)
CHEAP = frozenset({"aten.native_layer_norm.default", "aten.layer_norm.default",  # as traced and decomposed
                   "aten.clone.default", "aten._to_copy.default"})
CHAIN_DEPTH = 6  # how many cheap equations deep a recomputed value may reach back for its operands


def recomputable(e: Eqn) -> bool:
    """Cheap to redo in the backward instead of saving: views, pointwise ops, layer norms, copies."""
    op = resolve(e.op)
    return is_view(op) or torch.Tag.pointwise in op.tags or e.op in CHEAP


def free_to_redo(e: Eqn) -> bool:
    """Redone in the backward at no cost: views (metadata only; the base they read is what is kept)."""
    return is_view(resolve(e.op))


def _rematerialize(g: Graph, f: set[int], b: set[int], w: set[int], redo: Any = recomputable, *,
                   trade: bool = False) -> tuple[set[int], set[int]]:
    """F equations to recompute in B (`rb`) and in W (`rw`) instead of saving their outputs.

    A value a part reads is recomputed there when a chain of at most CHAIN_DEPTH equations that `redo`
    accepts (by default the cheap ones: views, pointwise, layer norms, copies; `free_to_redo`: views
    only) makes it from operands at hand anyway (an input, a value that
    part computes, or a value saved for another reason), so the saved bytes only fall: `gelu(fc)` and
    its view are redone from `fc`, which the gelu's backward keeps. A value both B and W need is
    recomputed in B and handed to W, so no equation runs in both B and W.

    `trade`: a saved value is also recomputed from operands that are not at hand when saving those operands
    instead takes fewer bytes: a float32 norm's input `x.float()` is redone from the bfloat16 `x` (half its
    bytes), which is then saved in its place. A trade is kept only where the bytes F hands on (less the stage's
    outputs, kept anyway) fall in total: the value may still be saved for the other part, or be an output.
    """
    prod, prim = g.producers(), set(g.inputs)
    kept = {v for v in g.outputs if isinstance(v, Var)}
    rb: set[int] = set()
    rw: set[int] = set()

    def held(rb: set[int], rw: set[int]) -> int:  # views of one value on its storage once, as F's outputs hold
        return held_bytes(g, _saved(g, f, _reads(g, b | rb), _reads(g, w | rw), rb, rw, prod) - kept)

    for _ in range(8):  # a fixed point: each pass may make further operands available
        saved = _saved(g, f, _reads(g, b | rb), _reads(g, w | rw), rb, rw, prod)
        grown = False
        for part, remat, other in ((b, rb, set()), (w, rw, rb)):
            done = remat | other  # F equations this part recomputes or gets recomputed from B
            barred = rw if remat is rb else set()  # B never redoes what W redoes: no equation runs in both

            def at_hand(x: Var) -> bool:
                j = prod.get(x)
                return x in prim or x in saved or j in part or j in done  # noqa: B023

            for v in _in_order(g, _reads(g, part | remat), prod):
                chain = _chain(g, prod, v, f, done | barred, at_hand, CHAIN_DEPTH, redo)
                if not chain and trade and v in saved:
                    chain = _traded(g, prod, v, f, done | barred, at_hand, redo, saved)
                    if chain:
                        before = held(rb, rw)
                        after = held(rb | chain, rw) if remat is rb else held(rb, rw | chain)
                        chain = chain if after < before else None
                if chain:
                    remat |= chain
                    done |= chain
                    grown = True
                    if trade:  # what the part now reads in v's place is saved from here on
                        saved = _saved(g, f, _reads(g, b | rb), _reads(g, w | rw), rb, rw, prod)
        if not grown:
            break
    return rb, rw


def _in_order(g: Graph, values: set[Var], prod: dict[Var, int]) -> list[Var]:
    """`values` by where they are made (a graph input by its position, -1 first; an equation's output by the
    equation's index and its place among the outputs): the same order in every process (a set of Vars iterates
    by address, and a greedy choice must be made alike on every rank)."""
    where = {v: (-1, k) for k, v in enumerate(g.inputs)}

    def key(v: Var) -> tuple[int, int]:
        j = prod.get(v)
        return where.get(v, (-1, -1)) if j is None else (j, next(k for k, o in enumerate(g.eqns[j].outputs) if o is v))

    return sorted(values, key=key)


def _traded(g: Graph, prod: dict[Var, int], v: Var, f: set[int], done: set[int], at_hand: Any, redo: Any,
            saved: set[Var]) -> set[int] | None:
    """F equations that recompute saved `v` from operands to save in its place, where those operands (not saved
    already) take fewer bytes than `v`; None if no chain of at most CHAIN_DEPTH does."""
    leaves: set[Var] = set()

    def chain(x: Var, depth: int) -> set[int] | None:
        j = prod.get(x)
        if depth == 0 or j is None or j not in f or j in done or not redo(g.eqns[j]):
            return None
        out = {j}
        for y in g.eqns[j].inputs:
            if not isinstance(y, Var) or at_hand(y):
                continue
            sub = chain(y, depth - 1)
            if sub is None:
                leaves.add(y)  # saved instead (an F value: every operand of an F equation is one, or an input)
            else:
                out |= sub
        return out

    found = chain(v, CHAIN_DEPTH)
    if found is None or any(prod.get(x) in found for x in leaves):
        return None
    cost = sum(x.aval.nbytes for x in leaves if x not in saved)
    return found if cost < v.aval.nbytes else None


def _chain(g: Graph, prod: dict[Var, int], v: Any, f: set[int], done: set[int], at_hand: Any,
           depth: int, redo: Any = recomputable) -> set[int] | None:
    """F equations (`redo` accepts each) that recompute `v` from values `at_hand`, or None if there is none."""
    j = prod.get(v)
    if depth == 0 or j is None or j not in f or j in done or not redo(g.eqns[j]):
        return None
    chain = {j}
    for x in g.eqns[j].inputs:
        if at_hand(x):
            continue
        sub = _chain(g, prod, x, f, done, at_hand, depth - 1, redo)
        if sub is None:
            return None
        chain |= sub
    return chain


def _recompute_all(g: Graph, f: set[int], b: set[int], w: set[int]) -> tuple[set[int], set[int]]:
    """Every F equation that B or W depends on is redone in B (W takes what it needs from B)."""
    prod = g.producers()
    needed = {v for v in _reads(g, b | w) if prod.get(v) in f}
    return _ancestors(g, list(needed), set()) & f, set()


# recompute level -> (F equations redone in B, redone in W)
RECOMPUTE: dict[Any, Any] = {
    False: lambda g, f, b, w: _rematerialize(g, f, b, w, free_to_redo),  # views only: eager autograd's kernels
    "cheap": lambda g, f, b, w: _rematerialize(g, f, b, w, trade=True),   # norms, copies, pointwise chains
    True: _recompute_all,                                                  # the whole forward
}


def recompute_level(value: Any) -> bool | str:
    """A recompute level: False, "cheap" or True (IRError otherwise)."""
    for level in RECOMPUTE:
        if value is level or (isinstance(value, str) and value == level):
            return level  # type: ignore[no-any-return]
    raise IRError(f"recompute must be False (save what the backward reads), 'cheap' (redo norms and pointwise "
                  f"chains) or True (redo the forward), got {value!r}")


def _reads(g: Graph, idx: set[int]) -> set[Var]:
    return {v for i in idx for v in g.eqns[i].inputs}


def _saved(g: Graph, f: set[int], b_need: set[Var], w_need: set[Var], rb: set[int], rw: set[int],
           prod: dict[Var, int] | None = None) -> set[Var]:
    """Values F must hand on: read (or returned) by B or W, made by an F equation the reader does not redo
    (`prod`: `g.producers()`, if the caller has it)."""
    prod = g.producers() if prod is None else prod
    for_b, for_w = f - rb, f - rw - rb  # the differences once, not once per value
    return {v for v in b_need if prod.get(v) in for_b} | {v for v in w_need if prod.get(v) in for_w}


def _needs(g: Graph, part: set[int], outputs: Sequence[Any]) -> set[Var]:
    """What a part reads, plus outputs it returns without computing them."""
    prod = g.producers()
    return _reads(g, part) | {v for v in outputs if isinstance(v, Var) and prod.get(v) not in part}


def _part(g: Graph, idx: set[int], slot: dict[Var, int], outputs: list[Var], redo: AbstractSet[int] = frozenset()
          ) -> Part:
    """Equations `idx` of the joint graph as a part; those in `redo` (recomputed forward work) run
    where their results are first needed, not up front."""
    sub = slice_graph(g, idx, outputs=outputs)
    sub = attrs.evolve(sub, eqns=_at_first_use(sub.eqns, {id(g.eqns[i]) for i in redo}))
    return Part(sub, tuple(slot[v] for v in sub.inputs), tuple(slot[v] for v in outputs))


def _at_first_use(eqns: Sequence[Eqn], lazy: set[int]) -> tuple[Eqn, ...]:
    """`eqns` with each equation whose id is in `lazy` moved down to just before its first reader (its
    own lazy producers before it). The joint graph lists recomputed forward work first: left there, a
    backward would hold every recomputed activation of the stage at once."""
    prod = {v: e for e in eqns for v in e.out_vars}
    out: list[Eqn] = []
    done: set[int] = set()
    for e in [*[e for e in eqns if id(e) not in lazy], *eqns]:  # lazy ones nobody reads go last
        stack = [(e, False)]
        while stack:
            x, ready = stack.pop()
            if id(x) in done:
                continue
            if ready:
                done.add(id(x))
                out.append(x)
                continue
            stack.append((x, True))
            stack.extend((p, False) for v in reversed(x.inputs) if (p := prod.get(v)) is not None
                         and id(p) in lazy and id(p) not in done)
    return tuple(out)


def stage_autodiff(g: Graph, *, constant: Sequence[int] = (), constant_outputs: Sequence[int] = (),
                   device: str | None = None, recompute: bool | str = False,
                   joints: MutableMapping[Any, Graph] | None = None) -> StageAD:
    """Forward / B / W graphs for a stage graph `g` (see StageAD). B differentiates the non-param
    float inputs except those in `constant` (batch leaves), W the float params (the first
    `g.num_params` inputs). Outputs in `constant_outputs` (a loss function's aux values) are computed by
    F but get no cotangent slot: nothing is differentiated through them. `device` overrides the graph's
    device for tracing.

    `backward` is B and W fused, for schedules that run them back to back (BW): each weight grad is
    computed right after the input grad it shares operands with, as eager autograd does, so the
    values B would hand to W never pile up for the whole stage.

    `recompute=True` is activation recomputation: F keeps nothing but the stage's outputs, and B
    redoes the forward work that B and W need (from the stage's inputs) before differentiating.
    `recompute="cheap"` redoes only norms, copies and short pointwise chains from operands kept anyway;
    False (the default) saves all B and W read, so the backward runs no extra kernels (see the module
    docstring).

    `joints`: a cache of traced joint graphs, keyed by the stage graph's text and what is differentiated.
    Tracing the joint is most of the cost, and it is the same at every recompute level (the levels only
    divide its equations differently), so a planner trying several levels on one stage traces it once.
    """
    level = recompute_level(recompute)
    n_in = len(g.inputs)
    diff_in, diff_out = diff_positions(g, constant, constant_outputs)
    jg = _own_grads(_joint(g, diff_in, diff_out, device, joints), len(g.outputs))
    outs = list(jg.outputs[: len(g.outputs)])
    grads = list(jg.outputs[len(g.outputs):])
    act_grads = [x for i, x in zip(diff_in, grads) if i >= g.num_params]
    param_grads = [x for i, x in zip(diff_in, grads) if i < g.num_params]
    f_idx = _ancestors(jg, outs, set())
    b_idx = _ancestors(jg, act_grads, f_idx)
    w_idx = _ancestors(jg, param_grads, f_idx | b_idx)
    rb, rw = RECOMPUTE[level](jg, f_idx, b_idx, w_idx)
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
    bwd = _part(jg, b_part, slot, list(dict.fromkeys(act_grads + stash_b)), rb)
    wgt = _part(jg, w_part, slot, param_grads, rw)
    fused = _part(jg, b_part | w_part, slot, list(dict.fromkeys(act_grads + param_grads)), rb | rw)
    grad_slots, ct_slots, avals = _slot_tables(slot, n_in, len(g.outputs), diff_in, grads, diff_out)
    return StageAD(fwd, bwd, wgt, len(slot), tuple(slot[v] for v in outs), ct_slots, grad_slots, avals, fused)


def diff_positions(g: Graph, constant: Sequence[int] = (), constant_outputs: Sequence[int] = ()
                   ) -> tuple[list[int], list[int]]:
    """The inputs stage autodiff differentiates (float, not `constant`) and the outputs that get a
    cotangent (float, not `constant_outputs`)."""
    skip, fixed = set(constant), set(constant_outputs)
    return ([i for i, v in enumerate(g.inputs) if _differentiable(v) and i not in skip],
            [j for j, v in enumerate(g.outputs) if isinstance(v, Var) and _differentiable(v) and j not in fixed])


def joint_key(g: Graph, diff_in: Sequence[int], diff_out: Sequence[int], device: str | None) -> tuple[Any, ...]:
    """What a traced joint depends on: the key of the `joints` cache `stage_autodiff` reads (the graph's text
    and constants: graphs that print alike may hold different constant tensors)."""
    return (program_digest(g), tuple(diff_in), tuple(diff_out), device)


def _slot_tables(slot: dict, n_in: int, n_out: int, diff_in: Sequence[int], grads: Sequence[Any],
                 diff_out: Sequence[int]) -> tuple[tuple, tuple, tuple]:
    """Where each input's grad lives, where each output's cotangent comes in, and every slot's aval."""
    grad_slots: list[int | None] = [None] * n_in
    for i, x in zip(diff_in, grads):
        grad_slots[i] = slot[x]
    ct_slots: list[int | None] = [None] * n_out
    for k, j in enumerate(diff_out):
        ct_slots[j] = n_in + k
    avals = [None] * len(slot)
    for v, s in slot.items():
        avals[s] = v.aval
    return tuple(grad_slots), tuple(ct_slots), tuple(avals)
