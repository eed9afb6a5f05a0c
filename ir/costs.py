"""Per-equation costs: FLOPs, bytes read and written, output bytes (what the splitter's model reads)."""
from __future__ import annotations

import math
from typing import Callable

import attrs

from .conv_costs import CONV_RULES, extra_read_bytes
from .core import Eqn, Graph, Var

FREE = frozenset({  # metadata-only ops: no arithmetic, no memory traffic
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
    "slice", "select", "alias", "detach", "as_strided", "split", "split_with_sizes", "unbind", "chunk",
    "narrow", "unflatten", "flatten", "view_as", "expand_as", "lift_fresh", "lift_fresh_copy",
})


@attrs.frozen
class EqnCost:
    """Arithmetic and memory traffic of one equation."""

    flops: int
    bytes_read: int
    bytes_written: int

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def base_name(op: str) -> str:
    """`aten.mm.default` -> `mm` (other namespaces' ops keep their full name)."""
    return op.split(".")[1] if op.startswith("aten.") else op


def _numel(v: Var) -> int:
    return v.aval.numel


def _matmul_flops(e: Eqn) -> int:
    a, b = e.inputs[0].aval.shape, e.inputs[1].aval.shape
    k = a[-1] if a else 1
    return 2 * k * math.prod(e.outputs[0].aval.shape)


def _addmm_flops(e: Eqn) -> int:
    return 2 * e.inputs[1].aval.shape[-1] * math.prod(e.outputs[0].aval.shape)


def _linear_flops(e: Eqn) -> int:
    return 2 * e.inputs[0].aval.shape[-1] * math.prod(e.outputs[0].aval.shape)


def _attention_flops(e: Eqn) -> int:
    q, k = e.inputs[0].aval.shape, e.inputs[1].aval.shape
    lq, lk, d = q[-2], k[-2], q[-1]
    dv = e.inputs[2].aval.shape[-1]
    return 2 * math.prod(q[:-2]) * lq * lk * (d + dv)


def _attention_backward_flops(e: Eqn) -> int:
    q = e.outputs[0].aval.shape if e.outputs[0] is not None else e.inputs[1].aval.shape
    k = e.inputs[2].aval.shape
    return int(2.5 * 2 * math.prod(q[:-2]) * q[-2] * k[-2] * 2 * q[-1])


def _elementwise_flops(e: Eqn) -> int:
    return sum(_numel(v) for v in e.out_vars) + sum(_numel(v) for v in e.inputs[:1])


FLOP_RULES: dict[str, Callable[[Eqn], int]] = {
    "mm": _matmul_flops, "bmm": _matmul_flops, "matmul": _matmul_flops, "addmm": _addmm_flops,
    "baddbmm": _addmm_flops, "linear": _linear_flops,
    "scaled_dot_product_attention": _attention_flops,
    "_scaled_dot_product_flash_attention": _attention_flops,
    "_scaled_dot_product_efficient_attention": _attention_flops,
    "_scaled_dot_product_cudnn_attention": _attention_flops,
    "_scaled_dot_product_flash_attention_for_cpu": _attention_flops,
    "_scaled_dot_product_flash_attention_backward": _attention_backward_flops,
    "_scaled_dot_product_efficient_attention_backward": _attention_backward_flops,
    "_scaled_dot_product_cudnn_attention_backward": _attention_backward_flops,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward_flops,
}


FLOP_RULES.update(CONV_RULES)  # convolutions (forward and backward), batch norm, pooling: ir/conv_costs.py


def eqn_cost(e: Eqn) -> EqnCost:
    """FLOPs by op rule (matmul 2mnk, attention 4·L²·d per head, else about one per element) and bytes
    as each input read once and each output written once; view-like ops cost nothing."""
    base = base_name(e.op)
    if base in FREE:
        return EqnCost(0, 0, 0)
    rule = FLOP_RULES.get(base, _elementwise_flops)
    read = sum(v.aval.nbytes for v in dict.fromkeys(e.inputs)) + extra_read_bytes(base, e)
    written = sum(v.aval.nbytes for v in e.out_vars)
    return EqnCost(int(rule(e)), read, written)


def graph_costs(g: Graph) -> tuple[EqnCost, ...]:
    return tuple(eqn_cost(e) for e in g.eqns)


def format_costs(g: Graph, *, top: int | None = None) -> str:
    """A table of the equations with their FLOPs and bytes, largest FLOPs first when `top` is set."""
    from .printer import Namer, format_eqn

    namer = Namer()
    for v in g.inputs:
        namer(v)
    rows = [(i, format_eqn(e, namer), eqn_cost(e)) for i, e in enumerate(g.eqns)]
    total = EqnCost(sum(c.flops for _, _, c in rows), sum(c.bytes_read for _, _, c in rows),
                    sum(c.bytes_written for _, _, c in rows))
    if top is not None:
        rows = sorted(rows, key=lambda r: -r[2].flops)[:top]
    lines = [f"{'#':>4} {'GFLOP':>10} {'MB read':>9} {'MB written':>10}  equation"]
    for i, text, c in rows:
        lines.append(f"{i:>4} {c.flops / 1e9:>10.4f} {c.bytes_read / 1e6:>9.3f} {c.bytes_written / 1e6:>10.3f}  {text[:90]}")
    lines.append(f"{'all':>4} {total.flops / 1e9:>10.4f} {total.bytes_read / 1e6:>9.3f} {total.bytes_written / 1e6:>10.3f}")
    return "\n".join(lines)
