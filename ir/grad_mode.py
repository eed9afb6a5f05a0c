"""Grad-mode regions as stop-gradients: what `torch.no_grad` computes is a constant to autodiff.

The pre-dispatch trace records `torch.no_grad()`, `torch.enable_grad()` and `torch.set_grad_enabled(b)`
as switches between ops; the importer marks every op run with grad off, and every op whose result is
an inference tensor (`torch.inference_mode()`, which leaves no switch in the trace). Such values carry
no gradient in eager PyTorch, so each one that is read with grad on (or returned) is read through an
`aten.detach`: stage autodiff then gives it no gradient, whatever stage it lands in, exactly as
`torch.func.grad` does. Hugging Face's rotary embeddings (`@torch.no_grad()` on
`LlamaRotaryEmbedding.forward`) are the motivating case.

The ops inside the region stay ordinary equations: they run in the forward, and a cut may fall anywhere.
"""
from __future__ import annotations

from typing import Collection

import attrs

from .core import Eqn, Graph, Var


def _differentiable(v: Var) -> bool:
    return v.aval.dtype.is_floating_point or v.aval.dtype.is_complex


def stop_gradients(g: Graph, frozen: Collection[Eqn]) -> Graph:
    """`g` with each float value made by a `frozen` equation read through `aten.detach.default` wherever an
    equation outside the region reads it or the graph returns it."""
    if not frozen:
        return g
    ids = {id(e) for e in frozen}
    read_outside = {v for e in g.eqns if id(e) not in ids for v in e.inputs}
    read_outside |= {v for v in g.outputs if isinstance(v, Var)}
    rename: dict[Var, Var] = {}
    eqns: list[Eqn] = []
    for e in g.eqns:
        if id(e) not in ids:
            eqns.append(e.replace_inputs(rename))
            continue
        eqns.append(e)
        for v in e.out_vars:
            if v in read_outside and _differentiable(v):
                rename[v] = Var(v.aval)
                eqns.append(Eqn("aten.detach.default", (v,), (), (rename[v],), source=e.source))
    outputs = tuple(rename.get(v, v) if isinstance(v, Var) else v for v in g.outputs)
    return attrs.evolve(g, eqns=tuple(eqns), outputs=outputs)
