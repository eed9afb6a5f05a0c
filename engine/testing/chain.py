"""One-process pipeline reference: run a graph's stages F in order, then B and W in reverse, and sum grads."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

import ir

__all__ = ["chain_value_and_grad"]


def _run(part: ir.Part, slots: dict[int, Any], compiled: bool) -> None:
    ins = [slots[i] for i in part.in_slots]
    outs = ir.compile_graph(part.graph)(*ins) if compiled else ir.interpret(part.graph, ins)
    slots.update(zip(part.out_slots, outs))


def _forward(stages: Sequence[ir.Stage], ads: Sequence[ir.StageAD], flat: list[Any],
             compiled: bool) -> list[dict[int, Any]]:
    acts: dict[int, Any] = {}  # value id -> tensor sent to the next stage
    per_stage = []
    for s, ad in zip(stages, ads):
        ins = [flat[i] for i in (*s.param_ids, *s.batch_ids)] + [acts[v] for v in s.acts_in]
        slots = dict(enumerate(ins))
        _run(ad.forward, slots, compiled)
        acts.update((v, slots[o]) for v, o in zip(s.acts_out, ad.out_slots))
        per_stage.append(slots)
    return per_stage


def _backward_input(stages: Sequence[ir.Stage], ads: Sequence[ir.StageAD], per_stage: list[dict[int, Any]],
                    compiled: bool) -> None:
    cts: dict[int, Any] = {}  # value id -> cotangent received from the next stage
    for s, ad, slots in reversed(list(zip(stages, ads, per_stage))):
        for j, c in enumerate(ad.ct_slots):
            if c is None:
                continue
            if j < len(s.acts_out):
                slots[c] = cts[s.acts_out[j]]
            else:  # the loss: d loss / d loss = 1
                out = slots[ad.out_slots[j]]
                slots[c] = torch.ones_like(out)
        _run(ad.backward_input, slots, compiled)
        base = len(s.param_ids) + len(s.batch_ids)
        for k, v in enumerate(s.acts_in):
            if ad.grad_slots[base + k] is not None:
                cts[v] = slots[ad.grad_slots[base + k]]


def chain_value_and_grad(graph: ir.Graph, params: Any, *batch: Any, cuts: Sequence[int] = (),
                         compiled: bool = True) -> tuple[Any, Any]:
    """`(fn(params, *batch), grad of it w.r.t. params)` computed the way a pipeline would, on one process.

    `graph` (from `ir.trace`, one scalar output) is split before each eqn index in `cuts`; every stage
    runs its F part in order, then every stage its B part in reverse order (cotangents flow back), then
    every W part. A param read by several stages (tied weights) gets the sum of their grads; a param no
    stage reads gets zeros, as `torch.func.grad` gives.
    """
    if len(graph.outputs) != 1:
        raise ValueError(f"chain_value_and_grad needs one scalar output (the loss); the graph has "
                         f"{len(graph.outputs)}")
    flat, tree = pytree.tree_flatten((params, *batch))
    stages = ir.split(graph, cuts)
    ads = [ir.stage_autodiff(s.graph, constant=range(len(s.param_ids), len(s.param_ids) + len(s.batch_ids)))
           for s in stages]
    per_stage = _forward(stages, ads, flat, compiled)
    loss = per_stage[-1][ads[-1].out_slots[len(stages[-1].acts_out)]]
    _backward_input(stages, ads, per_stage, compiled)
    grads: dict[int, torch.Tensor] = {}
    for s, ad, slots in reversed(list(zip(stages, ads, per_stage))):
        _run(ad.backward_weight, slots, compiled)
        for k, pid in enumerate(s.param_ids):
            if ad.grad_slots[k] is not None:
                g = slots[ad.grad_slots[k]]
                grads[pid] = grads[pid] + g if pid in grads else g
    num_params = graph.num_params
    flat_grads = [grads.get(i, torch.zeros_like(flat[i])) for i in range(num_params)]
    param_tree = pytree.tree_structure(params)
    out = pytree.tree_unflatten([loss], graph.out_tree) if graph.out_tree is not None else loss
    return out, pytree.tree_unflatten(flat_grads, param_tree)
