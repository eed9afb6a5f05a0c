"""Liveness of a graph's values as the compiled program runs it: the bytes it allocates, and their peak.

The compiled program (`ir.compile_graph`) frees each value after its last use, as fx's generated code
does. A view (or a metadata-only op such as `_unsafe_view`) allocates nothing and keeps its base's
storage alive; storage is released when the last value on it dies. Outputs stay allocated; an output
added in place into an accumulator (`accumulate`, see `ir.compile_graph`) dies right after its add. The
graph's inputs belong to the caller and are not counted.
"""
from __future__ import annotations

import weakref
from typing import Iterable, Sequence

import attrs

from .core import Eqn, Graph, Var
from .costs import FREE, base_name
from .purify import is_view, resolve

ALIASING = FREE - {"lift_fresh_copy"}  # metadata-only ops (a copy of a constant allocates)
CASTS = frozenset({"to", "type_as"})  # return their input where its dtype is already the one asked for, else a copy


@attrs.frozen
class RunBytes:
    """`peak`: the most bytes the run holds beyond its inputs (outputs made so far included);
    `outputs`: bytes still held at the end (outputs not on an input's storage, accumulated ones excluded);
    `transient`: the peak of values made and freed inside the run (outputs never counted)."""

    peak: int
    outputs: int
    transient: int


def allocates(op: str) -> bool:
    """Whether an equation's outputs get fresh storage (not views or metadata-only ops of an input)."""
    return not (base_name(op) in ALIASING or is_view(resolve(op)))


def _makes(e: Eqn, first: Var | None) -> bool:
    """Whether `e`'s outputs get fresh storage: its op allocates, or it casts (`to` another dtype: a copy, though
    the schema says it may return its input)."""
    if allocates(e.op) or first is None:
        return True
    return base_name(e.op) in CASTS and any(v.aval.dtype != first.aval.dtype for v in e.out_vars)


def owners(g: Graph) -> tuple[dict[Var, Var], frozenset[Var]]:
    """Each value of `g` -> the value whose storage it lives on (itself where its op allocates, else its first
    input's: views and in-place ops), and the values whose storage `g`'s run makes (not its inputs)."""
    if g not in _OWNERS:
        storage: dict[Var, Var] = {v: v for v in g.inputs}
        made: set[Var] = set()
        for e in g.eqns:
            first = next(iter(e.inputs), None)
            makes = _makes(e, first)
            for v in e.out_vars:
                storage[v] = v if makes else storage[first]  # type: ignore[index]
                if storage[v] is v:
                    made.add(v)
        _OWNERS[g] = (storage, frozenset(made))
    return _OWNERS[g]


_OWNERS: weakref.WeakKeyDictionary[Graph, tuple[dict[Var, Var], frozenset[Var]]] = weakref.WeakKeyDictionary()


def output_storage(g: Graph) -> tuple[tuple[int, int] | None, ...]:
    """Per output of `g`: (the first output position on the same storage, that storage's bytes) where the run
    makes the storage, None for a literal or an output on an input's storage. Outputs that are views of one
    value (a Linear's `view(x, [b*t, d])` made once per matmul reading x, each saved for its weight grad) share
    one storage: the caller holds its bytes once, until the last of them dies."""
    storage, made = owners(g)
    seen: dict[Var, int] = {}
    out: list[tuple[int, int] | None] = []
    for k, v in enumerate(g.outputs):
        owner = storage.get(v) if isinstance(v, Var) else None
        if owner is None or owner not in made:
            out.append(None)
            continue
        out.append((seen.setdefault(owner, k), owner.aval.nbytes))
    return tuple(out)


def output_inputs(g: Graph) -> tuple[int | None, ...]:
    """Per output of `g`: the position of the input whose storage it lives on (the input itself or a view of
    it), None for an output on a storage the run makes, or a literal."""
    storage = owners(g)[0]
    position = {v: k for k, v in enumerate(g.inputs)}
    return tuple(position.get(storage[v]) if isinstance(v, Var) else None for v in g.outputs)


def output_views(g: Graph) -> tuple[bool, ...]:
    """Per output of `g`: whether it is a view (or metadata-only result) of another value's storage, an input's
    included, and so may have any strides; False for a value an op allocated, or a literal."""
    storage = owners(g)[0]
    return tuple(isinstance(v, Var) and storage[v] is not v for v in g.outputs)


def held_bytes(g: Graph, values: Iterable[Var]) -> int:
    """Bytes `values` (of `g`) hold: each storage `g` made once, a value on an input's storage at its own size."""
    storage, made = owners(g)
    values = list(values)
    mine = {storage[v] for v in values if storage[v] in made}
    return sum(v.aval.nbytes for v in values if storage[v] not in made) + sum(o.aval.nbytes for o in mine)


def run_bytes(g: Graph, accumulate: Sequence[int] = ()) -> RunBytes:
    """Walk `g` in order with fx's frees (see the module docstring) and report its bytes."""
    added = set(accumulate)
    held = {v for k, v in enumerate(g.outputs) if isinstance(v, Var) and k not in added}
    last = {v: i for i, e in enumerate(g.eqns) for v in e.inputs}  # an accumulated output dies after its add
    storage = owners(g)[0]                              # value -> the value that owns its storage
    users: dict[Var, int] = {v: 1 for v in g.inputs}   # owner -> live values on it (inputs pinned)
    size: dict[Var, int] = {}                           # owner -> bytes, for storage this run made
    kept: set[Var] = set()                              # owners of outputs' storage
    live = peak = kept_live = transient = 0

    def release(owner: Var) -> None:
        nonlocal live, kept_live
        users[owner] -= 1
        if users[owner] == 0 and owner in size:
            live -= size[owner]
            kept_live -= size[owner] if owner in kept else 0

    for i, e in enumerate(g.eqns):
        for v in e.out_vars:
            owner = storage[v]
            users[owner] = users.get(owner, 0) + 1
            if owner is v:
                size[v] = v.aval.nbytes
                live += size[v]
            if v in held and owner in size and owner not in kept:
                kept.add(owner)
                kept_live += size[owner]
        peak, transient = max(peak, live), max(transient, live - kept_live)
        for v in dict.fromkeys(e.inputs):
            if last.get(v) == i and v not in held:
                release(storage[v])
        for v in e.out_vars:  # made and never read nor returned
            if v not in last and v not in held:
                release(storage[v])
    return RunBytes(peak, kept_live, transient)
