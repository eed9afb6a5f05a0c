"""How contractions move the batch's rows (rules of `ir.batch_rows`): matmul, linear, einsum, attention, conv.

A contraction keeps rows that sit in a dim it does not sum over. It mixes them when two operands put
rows in two different output dims (`a @ b.T` with both batched: CLIP's [B, B] logits), or when it sums
over one operand's rows for each row of the other. Summing over the rows of both operands together
(`a.T @ b`, a sum of per-row products) or over one operand's rows against a constant is a sum over rows.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .batch_state import UNKNOWN, Ctx, Mixes, Rows, Rule, agree, rows, shape_of, summed

__all__ = ["CONTRACT_RULES"]

_CROSS = "sums over the batch's rows of one operand for each row of the other: every row meets every other"


def _summed_or_unknown(c: Ctx, states: Sequence[Rows], *, linear: bool = True) -> Rows | None:
    """unknown when an operand is; a sum over rows when one operand is that and the rest are clean (for ops
    linear in each operand); None when no operand is either."""
    if any(s.unknown for s in states):
        return UNKNOWN
    sums = [s for s in states if s.summed]
    if not sums:
        return None
    if not linear:
        raise Mixes(f"takes the non-linear `{c.op}` of a sum or mean over the batch's rows (made by "
                    f"`{sums[0].origin}`)")
    if len(sums) > 1 or any(s.rows for s in states):
        raise Mixes(f"`{c.op}` multiplies a sum or mean over the batch's rows (made by `{sums[0].origin}`) by "
                    "another value that reads the batch")
    return sums[0]


def _matmul(c: Ctx, a_shape: Sequence[int], sa: Rows, b_shape: Sequence[int], sb: Rows, *,
            linear: bool = True) -> Rows:
    """The state of `a @ b` (matmul's broadcasting and 1-D rules); `linear` False for cdist (distances)."""
    known = _summed_or_unknown(c, (sa, sb), linear=linear)
    if known is not None:
        return known
    na, nb, nout = len(a_shape), len(b_shape), len(c.out_shape())
    lead = nout - (na >= 2) - (nb >= 2)
    summed_a = sa.rows and sa.dim == na - 1
    summed_b = sb.rows and sb.dim == max(nb - 2, 0)
    if summed_a or summed_b:
        return _contracted(c, sa, sb, summed_a, summed_b, linear)
    found = []
    if sa.rows:
        found.append((lead if sa.dim == na - 2 else sa.dim + lead - (na - 2), sa.inner))
    if sb.rows:
        found.append((nout - 1 if sb.dim == nb - 1 else sb.dim + lead - (nb - 2), sb.inner))
    return c.checked(agree(found), c.out_shape())


def _contracted(c: Ctx, sa: Rows, sb: Rows, summed_a: bool, summed_b: bool, linear: bool) -> Rows:
    if summed_a and summed_b and sa.inner != sb.inner:
        raise Mixes(f"`{c.op}` sums products of different rows of the batch")
    if (sa.rows and not summed_a) or (sb.rows and not summed_b):
        raise Mixes(f"`{c.op}` {_CROSS}")
    if not linear:
        raise Mixes(f"`{c.op}` measures distances across the batch's rows")
    return summed(c.op)


def matmul(c: Ctx) -> list[Rows]:
    """matmul, mm, bmm, mv, dot, vdot."""
    a, b = c.eqn.args[:2]
    return c.outputs(_matmul(c, shape_of(a), c.state(a), shape_of(b), c.state(b)))


def _transposed(w: Any, s: Rows) -> tuple[tuple[int, ...], Rows]:
    """A [out, in] weight as the [in, out] right operand of a matmul."""
    shape = shape_of(w)
    if len(shape) < 2:
        return shape, s
    return (shape[1], shape[0]), (rows(1 - s.dim, s.inner) if s.rows else s)


def _plus(c: Ctx, out: Rows, bias: Any) -> list[Rows]:
    """`out` plus a broadcast term (a bias, addmm's self)."""
    sb = c.state(bias)
    if sb.clean:
        return c.outputs(out)
    if sb.unknown or out.unknown:
        return c.outputs(UNKNOWN)
    if sb.summed or out.summed:
        if sb.rows or out.rows:
            raise Mixes(f"`{c.op}` adds a sum over the batch's rows to a value that carries them")
        return c.outputs(out if out.summed else sb)
    nout = len(c.out_shape())
    found = [(sb.dim + nout - len(shape_of(bias)), sb.inner)] + ([(out.dim, out.inner)] if out.rows else [])
    return c.outputs(c.checked(agree(found), c.out_shape()))


def linear(c: Ctx) -> list[Rows]:
    x, w = c.arg("input"), c.arg("weight")
    shape, sw = _transposed(w, c.state(w))
    return _plus(c, _matmul(c, shape_of(x), c.state(x), shape, sw), c.arg("bias"))


def addmm(c: Ctx) -> list[Rows]:
    """addmm / addmv / baddbmm: self + a @ b."""
    bias, a, b = c.eqn.args[:3]
    return _plus(c, _matmul(c, shape_of(a), c.state(a), shape_of(b), c.state(b)), bias)


def cdist(c: Ctx) -> list[Rows]:
    """Distances between the rows of x1 [..., P, M] and of x2 [..., R, M]: a matmul with x2 transposed."""
    x1, x2 = c.arg("x1"), c.arg("x2")
    s2, n2 = c.state(x2), len(shape_of(x2))
    flip = {n2 - 1: n2 - 2, n2 - 2: n2 - 1}
    s2t = rows(flip.get(s2.dim, s2.dim), s2.inner) if s2.rows else s2
    shape2 = (*shape_of(x2)[:-2], shape_of(x2)[-1], shape_of(x2)[-2])
    return c.outputs(_matmul(c, shape_of(x1), c.state(x1), shape2, s2t, linear=False))


# --------------------------------------------------------------------------- einsum


def _labels(term: str, ndim: int, width: int | None = None) -> list[str]:
    """One label per dim; the dims under `...` are labelled from the right (`…0` last), so they broadcast."""
    if "..." not in term:
        return list(term)
    head, tail = term.split("...")
    n = (width if width is not None else ndim - len(head) - len(tail))
    return list(head) + [f"…{n - 1 - j}" for j in range(n)] + list(tail)


def einsum(c: Ctx) -> list[Rows]:
    equation = re.sub(r"\s", "", c.arg("equation"))
    operands = list(c.arg("tensors"))
    lhs, arrow, rhs = equation.partition("->")
    terms = [_labels(t, len(shape_of(x))) for t, x in zip(lhs.split(","), operands)]
    width = max((sum(lab.startswith("…") for lab in t) for t in terms), default=0)
    if arrow:
        out = _labels(rhs, 0, width)
    else:
        counts = [lab for t in terms for lab in t if not lab.startswith("…")]
        out = [f"…{width - 1 - j}" for j in range(width)] + sorted(x for x in set(counts) if counts.count(x) == 1)
    states = [c.state(x) for x in operands]
    known = _summed_or_unknown(c, states)
    if known is not None:
        return c.outputs(known)
    found = sorted({(t[s.dim], s.inner) for t, s in zip(terms, states) if s.rows})
    if not found:
        return c.outputs(states[0] if states else UNKNOWN)
    labels = {lab for lab, _ in found}
    if len(labels) == 1 and len(found) > 1:
        raise Mixes(f"einsum '{equation}' lines up different rows of the batch")
    if len(labels) > 1:
        if labels <= set(out):  # every row label kept: the output pairs them
            agree([(out.index(lab), inner) for lab, inner in found])
        raise Mixes(f"einsum '{equation}' {_CROSS}")
    label, inner = found[0]
    if label not in out:
        return c.outputs(summed(c.op))
    return c.outputs(c.checked(rows(out.index(label), inner), c.out_shape()))


# --------------------------------------------------------------------------- attention, convolution, pooling


def attention(c: Ctx) -> list[Rows]:
    """scaled_dot_product_attention: q [..., L, E], k [..., S, E], v [..., S, Ev], mask [..., L, S] -> [..., L, Ev].
    Rows in the leading dims (or q's L) pass; rows among the keys (S) or features (E) are attended across."""
    nout = len(c.out_shape())
    found = []
    states = [c.state(c.arg(n)) for n in ("query", "key", "value", "attn_mask")]
    known = _summed_or_unknown(c, states, linear=False)
    if known is not None:
        return c.outputs(known)
    for name, s in zip(("query", "key", "value", "attn_mask"), states):
        if not s.rows:
            continue
        n = len(shape_of(c.arg(name)))
        last, second = n - 1, n - 2
        place = {"query": {second: nout - 2}, "key": {}, "value": {last: nout - 1},
                 "attn_mask": {second: nout - 2}}[name]
        if s.dim in (last, second) and s.dim not in place:
            raise Mixes(f"attends across the batch's rows: the {name}'s dim {s.dim} carries them, so each query "
                        "reads other rows")
        found.append((place.get(s.dim, s.dim + nout - n), s.inner))
    return c.outputs(c.checked(agree(found), c.out_shape()))


def convolution(c: Ctx) -> list[Rows]:
    """conv / conv_transpose: rows in the batch dim 0 of a batched input pass (a linear map of each sample)."""
    x, w = c.arg("input"), c.arg("weight")
    sx = c.state(x)
    if not (c.state(w).clean and c.state(c.arg("bias")).clean) or sx.unknown:
        return c.outputs(UNKNOWN)
    if sx.summed:
        return c.outputs(sx)
    batched = len(shape_of(x)) == len(shape_of(w))
    return c.outputs(c.checked(sx, c.out_shape()) if batched and sx.dim == 0 else UNKNOWN)


def pooling(c: Ctx) -> list[Rows]:
    """Pooling and upsampling over the trailing spatial dims named by the op (`max_pool2d`: two)."""
    x = c.first
    s, ndim = c.state(x), len(shape_of(x))
    spatial = int(re.search(r"(\d)d", c.op).group(1))  # type: ignore[union-attr]
    if s.rows and s.dim < ndim - spatial:
        return [c.checked(s, v.aval.shape) if v is not None else UNKNOWN for v in c.eqn.outputs]
    return c.outputs(UNKNOWN if not s.clean else s)


_POOLS = ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
          "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "_adaptive_avg_pool3d",
          "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d", "max_pool1d_with_indices",
          "max_pool2d_with_indices", "max_pool3d_with_indices", "upsample_nearest1d", "upsample_nearest2d",
          "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
          "upsample_trilinear3d", "_upsample_nearest_exact2d")

CONTRACT_RULES: dict[str, Rule] = {
    **{op: matmul for op in ("matmul", "mm", "bmm", "mv", "dot", "vdot")},
    "linear": linear, "addmm": addmm, "addmv": addmm, "baddbmm": addmm, "cdist": cdist, "einsum": einsum,
    "scaled_dot_product_attention": attention,
    **{op: convolution for op in ("convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                                  "conv_transpose2d", "conv_transpose3d")},
    **{op: pooling for op in _POOLS},
}
