"""Sinking: equations that read only graph inputs move to just before their first use.

A traced function often prepares its inputs up front: `engine.functionalize` detaches every buffer of the
module at the start of the call, a model may cast or transpose its weights, or build a constant, long
before the layer that uses it. In the traced order those equations sit at the top of the graph, so a
stage cut anywhere after them turns each such value into an activation that stage 0 computes and sends
down the pipeline every microbatch: a wide ResNet cut in two sent ~100 detached BatchNorm buffers per
microbatch beside its one real activation. Moved next to their consumer, they are computed by the stage
that uses them, from the params and batch leaves that stage holds anyway.

What moves: an equation all of whose operands are params (buffers are params here) or outputs of
equations that move (a chain such as detach -> to); factory equations with no operand too. Nothing that
reads a batch leaf moves: that is the model's computation, already in order. Each goes
right before the first equation that reads one of its outputs, its own movable producers before it, so
the order stays topological; one read only by the graph's outputs goes to the end. Everything else keeps
its relative order. It runs once, when a graph is traced, so every rank and every cost sees the same
order.
"""
from __future__ import annotations

import attrs

from .core import Eqn, Graph, Var


def sink_input_ops(g: Graph) -> Graph:
    """`g` with its input-only equations moved to just before their first consumer (see module docstring)."""
    ready = set(g.inputs[:g.num_params])  # params (and buffers); batch leaves are data, not preparation
    movable: dict[Var, Eqn] = {}
    for e in g.eqns:
        if all(v in ready or v in movable for v in e.inputs):
            movable.update((v, e) for v in e.out_vars)
    if not movable:
        return g
    order: list[Eqn] = []
    placed: set[int] = set()

    def place(e: Eqn) -> None:
        if id(e) in placed:
            return
        placed.add(id(e))
        for v in e.inputs:
            if v in movable:
                place(movable[v])
        order.append(e)

    moved = {id(e) for e in movable.values()}
    for e in g.eqns:
        if id(e) in moved:
            continue
        for v in e.inputs:
            if v in movable:
                place(movable[v])
        order.append(e)
    for e in g.eqns:  # read only by the outputs, or by nothing
        if id(e) in moved:
            place(e)
    return attrs.evolve(g, eqns=tuple(order))
