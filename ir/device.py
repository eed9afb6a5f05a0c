"""Which device a graph targets, whether this machine can run it, and re-targeting a graph to another."""
from __future__ import annotations

import re
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from .core import Eqn, Graph, Var
from .errors import IRError


def device_type(device: str | torch.device) -> str:
    """`cuda` for "cuda:1" or torch.device("cuda", 1)."""
    return torch.device(device).type


_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|mps|hpu|mtia|privateuseone):\d+\b")


def rank_neutral(text: str) -> str:
    """`text` (a printed graph, an op's arguments) without device indices: a factory op traced on rank 1
    prints `device=cuda:1` where rank 0's prints `device=cuda:0` (RoPE's `arange(..., device=x.device)`);
    each rank runs its program on its own device, so the index is no difference between the ranks."""
    return _DEVICE_INDEX.sub(r"\1", text)


def available(device: str | torch.device) -> bool:
    """Whether this process can run kernels on `device` (cpu always; cuda, xpu, mps when present)."""
    kind = device_type(device)
    if kind in ("cpu", "meta"):
        return True
    backend = getattr(torch, kind, None)
    is_available = getattr(backend, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def graph_devices(g: Graph) -> set[str]:
    """The device types of the graph's values."""
    return {device_type(v.aval.device) for v in g.defined()}


def require_runnable(g: Graph) -> None:
    """Raise IRError when the graph's values live on a device this machine lacks: tracing, checking,
    costing, splitting and differentiating a graph need no device, running it does."""
    missing = sorted(d for d in graph_devices(g) if not available(d))
    if missing:
        raise IRError(
            f"this graph was traced for {missing[0]}, which this machine does not have "
            f"(torch.{missing[0]}.is_available() is False), so it cannot run here. A graph traced for another "
            "device is for planning (ir.check, ir.format_costs, ir.split, ir.stage_autodiff, engine.plan); to run "
            "it, trace again for this machine: ir.trace(fn, params, *batch) without device=, or device='cpu'")


def _swap_device(x: Any, src: str, dst: str) -> Any:
    if isinstance(x, torch.device) and x.type == src:
        return torch.device(dst)
    if isinstance(x, str) and (x == src or x.startswith(src + ":")):
        return dst
    return x


def retarget(g: Graph, src: str, dst: str) -> Graph:
    """The same program with every value and device argument on device type `src` moved to device
    `dst`. Op choices are kept: a graph traced
    for the CPU and re-targeted to cuda keeps CPU kernels such as `_scaled_dot_product_flash_attention_for_cpu`,
    which is what planning on a machine without the device can do."""
    new: dict[Var, Var] = {}

    def var(v: Var) -> Var:
        if v not in new:
            moved = device_type(v.aval.device) == src
            new[v] = Var(attrs.evolve(v.aval, device=dst)) if moved else v
        return new[v]

    def sub(x: Any) -> Any:
        return var(x) if isinstance(x, Var) else _swap_device(x, src, dst)

    inputs = tuple(var(v) for v in g.inputs)
    eqns = []
    for e in g.eqns:
        args = pytree.tree_map(sub, e.args)
        kwargs = tuple((k, pytree.tree_map(sub, v)) for k, v in e.kwargs)
        outs = tuple(None if v is None else var(v) for v in e.outputs)
        eqns.append(Eqn(e.op, args, kwargs, outs, e.multi, e.source, e.nested))
    outputs = tuple(var(v) if isinstance(v, Var) else v for v in g.outputs)
    return attrs.evolve(g, inputs=inputs, eqns=tuple(eqns), outputs=outputs)
