"""How indexing, slicing, joining and padding ops move the batch's rows (rules of `ir.batch_rows`).

Picking along the rows' dim by a constant (`x[0]`, `x[1:]`, `x.roll(1, 0)`) or by the data (`x[perm]`) makes
the result unknown: it does depend on how the batch is cut, but whether rows end up compared is for later
ops to show, and they cannot (unknown is never refused). `arange(n)` as the index of the rows' dim
(`x[torch.arange(B), last]`, Hugging Face's pooling) keeps each row in place.
"""
from __future__ import annotations

from typing import Any

import torch

from .batch_state import UNKNOWN, Ctx, Mixes, Rows, Rule, agree, norm_dim, reshaped, rows, shape_of, summed

__all__ = ["INDEX_RULES"]



def picks(rule: Rule) -> Rule:
    """`rule` for rows and clean values; a sum over rows picked from by clean indices stays one (a linear
    map), anything else unknown or summed makes the outputs unknown."""
    def wrapped(c: Ctx) -> list[Rows]:
        states = [c.state(x) for x in c.tensors()]
        if any(s.unknown for s in states):
            return c.outputs(UNKNOWN)
        if any(s.summed for s in states):
            first = c.state(c.first)
            ok = first.summed and all(c.state(x).clean for x in c.tensors() if x is not c.first)
            return c.outputs(summed(first.origin) if ok else UNKNOWN)
        return rule(c)
    return wrapped


def _moved(c: Ctx, s: Rows, at: int) -> list[Rows]:
    return c.outputs(c.checked(rows(at, s.inner), c.out_shape()))


def _dim(c: Ctx, x: Any, name: str = "dim") -> int:
    return norm_dim(int(c.arg(name)), max(len(shape_of(x)), 1))


# --------------------------------------------------------------------------- picking


def index(c: Ctx) -> list[Rows]:
    """`x[i, j, ...]` (advanced indexing): the indexed dims are replaced by the indices' broadcast shape, in
    place when they are adjacent, else in front."""
    x, idx = c.arg("self"), list(c.arg("indices"))
    sx, shape = c.state(x), shape_of(x)
    if any(i is not None and i.aval.dtype == torch.bool for i in idx):
        return c.outputs(UNKNOWN)  # masks (their shapes depend on the data, refused at trace anyway)
    at = [k for k, i in enumerate(idx) if i is not None]
    width = max(len(shape_of(idx[k])) for k in at)
    adjacent = at == list(range(at[0], at[-1] + 1))
    start = at[0] if adjacent else 0
    found = [(start + c.state(i).dim + width - len(shape_of(i)), c.state(i).inner)
             for i in idx if i is not None and c.state(i).rows]
    if sx.rows:
        if sx.dim in at:
            i = idx[sx.dim]
            si = c.state(i)
            if not (si.iota and shape_of(i)[si.dim] == shape[sx.dim]):
                return c.outputs(UNKNOWN)  # rows picked by a constant or by the data
            found.append((start + si.dim + width - len(shape_of(i)), sx.inner))
        elif adjacent:
            found.append((sx.dim if sx.dim < at[0] else sx.dim - len(at) + width, sx.inner))
        else:
            found.append((width + [k for k in range(len(shape)) if k not in at].index(sx.dim), sx.inner))
    return c.outputs(c.checked(agree(found), c.out_shape()))


def index_select(c: Ctx) -> list[Rows]:
    x, i = c.arg("self"), c.arg("index")
    sx, si, d = c.state(x), c.state(i), _dim(c, x)
    if sx.rows and sx.dim == d:
        return _moved(c, sx, d) if si.iota and shape_of(i)[si.dim] == shape_of(x)[d] else c.outputs(UNKNOWN)
    found = ([(sx.dim, sx.inner)] if sx.rows else []) + ([(d, si.inner)] if si.rows else [])
    return c.outputs(c.checked(agree(found), c.out_shape()))


def gather(c: Ctx) -> list[Rows]:
    """`x.gather(dim, index)`: the output is shaped like the index; rows of x along `dim` are picked by it."""
    x, i = c.arg("self"), c.arg("index")
    sx, si, d = c.state(x), c.state(i), _dim(c, x)
    if sx.rows and (sx.dim == d or shape_of(x)[sx.dim] != shape_of(i)[sx.dim]):
        return c.outputs(UNKNOWN)
    found = [(s.dim, s.inner) for s in (sx, si) if s.rows]
    return c.outputs(c.checked(agree(found), c.out_shape()))


def embedding(c: Ctx) -> list[Rows]:
    """`weight[indices]`: the indices' rows, with the embedding dim appended."""
    if not c.state(c.arg("weight")).clean:
        return c.outputs(UNKNOWN)
    return c.outputs(c.state(c.arg("indices")))


def one_hot(c: Ctx) -> list[Rows]:
    return c.outputs(c.state(c.arg("self")))


def select(c: Ctx) -> list[Rows]:
    x = c.arg("self")
    s, d = c.state(x), _dim(c, x)
    if not s.rows:
        return c.outputs(s)
    return c.outputs(UNKNOWN) if s.dim == d else _moved(c, s, s.dim - (d < s.dim))


def _whole(size: int, start: Any, end: Any, step: Any = 1) -> bool:
    return (start in (None, 0)) and (end is None or end >= size) and step in (None, 1)


def slice_(c: Ctx) -> list[Rows]:
    """slice / narrow: along the rows' dim only the whole of it keeps them."""
    x = c.arg("self")
    s, d = c.state(x), _dim(c, x)
    if not s.rows or s.dim != d:
        return c.outputs(c.checked(s, c.out_shape()) if s.rows else s)
    size = shape_of(x)[d]
    whole = (_whole(size, c.arg("start"), c.arg("end"), c.arg("step")) if c.op == "slice"
             else _whole(size, c.arg("start"), c.arg("start") + c.arg("length")))
    return c.outputs(s if whole else UNKNOWN)


def split(c: Ctx) -> list[Rows]:
    """split / chunk / unbind / tensor_split: each piece keeps the rows unless the cut is along them."""
    x = c.arg("self")
    s, d = c.state(x), _dim(c, x)
    if not s.rows:
        return c.outputs(s)
    if s.dim == d:
        return c.outputs(UNKNOWN)
    at = s.dim - (d < s.dim) if c.op == "unbind" else s.dim
    return [c.checked(rows(at, s.inner), v.aval.shape) if v is not None else UNKNOWN for v in c.eqn.outputs]


# --------------------------------------------------------------------------- joining


def cat(c: Ctx) -> list[Rows]:
    """Along another dim the parts must agree; along the rows' dim every part must hold whole rows in the same
    layout (`torch.cat([a, b])` of two [B, D] values: index i belongs to row i % B)."""
    parts = [t for t in c.arg("tensors") if t is not None and t.aval.numel]
    states = [c.state(t) for t in parts]
    ndim = len(c.out_shape())
    d = norm_dim(int(c.arg("dim")), ndim)
    found = [(s.dim, s.inner) for s in states if s.rows]
    if any(dim == d for dim, _ in found):
        same = all(s.rows and (s.dim, s.inner) == found[0] for s in states)
        return c.outputs(c.checked(rows(*found[0]), c.out_shape()) if same else UNKNOWN)
    return c.outputs(_joined(c, found))


def stack(c: Ctx) -> list[Rows]:
    parts = list(c.arg("tensors"))
    ndim = len(c.out_shape())
    d = norm_dim(int(c.arg("dim")), ndim)
    found = [(s.dim + (s.dim >= d), s.inner) for t in parts if (s := c.state(t)).rows]
    return c.outputs(_joined(c, found))


def _joined(c: Ctx, found: list[tuple[int, int]]) -> Rows:
    """Parts that put their rows in one place keep them; parts that put them in different dims pair every row
    with every other (a relation network's or a cross-encoder's `cat([a[:, None].expand(n, n, d),
    b[None].expand(n, n, d)], -1)`: position [i, j] holds row i beside row j), Mixes as `agree` says."""
    try:
        return c.checked(agree(found), c.out_shape())
    except Mixes as mix:
        raise Mixes(f"joins parts that hold the batch's rows in different places: {mix}") from None


def pad(c: Ctx) -> list[Rows]:
    """pad / constant_pad_nd / reflection / replicate: pads (left, right) pairs from the last dim back."""
    x = c.first
    s, ndim = c.state(x), len(shape_of(x))
    widths = list(c.arg("pad" if c.has("pad") else "padding"))
    padded = {ndim - 1 - j // 2 for j, w in enumerate(widths) if w}
    return c.outputs(UNKNOWN if s.rows and s.dim in padded else s)


def repeat(c: Ctx) -> list[Rows]:
    """Tiling keeps index i of the rows' dim in row (i // inner) % m."""
    x = c.arg("self")
    s = c.state(x)
    lead = len(c.out_shape()) - len(shape_of(x))
    return _moved(c, s, s.dim + lead) if s.rows else c.outputs(s)


def repeat_interleave(c: Ctx) -> list[Rows]:
    """Each element repeated r times along `dim` (all flattened when dim is None): rows stay whole, r times
    wider."""
    x, r, dim = c.arg("self"), c.arg("repeats"), c.arg("dim")
    s = c.state(x)
    if not s.rows:
        return c.outputs(s)
    if dim is None:
        s, at = reshaped(s, shape_of(x), (max(x.aval.numel, 1),), c.m), 0
    else:
        at = norm_dim(int(dim), len(shape_of(x)))
    if not s.rows or s.dim != at:
        return c.outputs(c.checked(s, c.out_shape()) if s.rows else s)
    return c.outputs(c.checked(rows(at, s.inner * int(r)), c.out_shape()) if isinstance(r, int) else UNKNOWN)


def along_dims(name: str, last_two: bool = False) -> Rule:
    """flip / roll / tril / triu: positions move inside the named dims (the last two for tril / triu)."""
    def rule(c: Ctx) -> list[Rows]:
        x = c.first
        s, ndim = c.state(x), len(shape_of(x))
        dims = [ndim - 2, ndim - 1] if last_two else c.arg(name)
        dims = [dims] if isinstance(dims, int) else list(dims)
        moved = {norm_dim(int(d), ndim) for d in dims} if dims else set(range(ndim))
        return c.outputs(UNKNOWN if s.rows and s.dim in moved else s)
    return rule


def slice_scatter(c: Ctx) -> list[Rows]:
    """`self` with a slice (select_scatter: one index) along `dim` replaced by `src`."""
    x, src = c.arg("self"), c.arg("src")
    d = _dim(c, x)
    sx, ss = c.state(x), c.state(src)
    dropped = c.op == "select_scatter"
    at = [(sx.dim, sx.inner)] if sx.rows else []
    if ss.rows:
        at.append((ss.dim + (dropped and ss.dim >= d), ss.inner))
    if any(dim == d for dim, _ in at):
        return c.outputs(UNKNOWN)
    return c.outputs(c.checked(agree(at), c.out_shape()))


INDEX_RULES: dict[str, Rule] = {
    "index.Tensor": picks(index), "_unsafe_index.Tensor": picks(index), "index_select": picks(index_select),
    "gather": picks(gather), "embedding": embedding, "one_hot": one_hot, "select.int": picks(select),
    "slice.Tensor": picks(slice_), "narrow": picks(slice_),
    **{op: picks(split) for op in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split",
                                   "unsafe_split", "unsafe_chunk", "split_copy", "unbind_copy")},
    "cat": picks(cat), "concat": picks(cat), "concatenate": picks(cat), "stack": picks(stack),
    **{op: picks(pad) for op in ("pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d",
                                 "reflection_pad3d", "replicate_pad1d", "replicate_pad2d", "replicate_pad3d")},
    "repeat": picks(repeat), "tile": picks(repeat), "repeat_interleave.self_int": picks(repeat_interleave),
    "flip": picks(along_dims("dims")), "roll": picks(along_dims("dims")),
    "tril": picks(along_dims("", last_two=True)), "triu": picks(along_dims("", last_two=True)),
    "slice_scatter": picks(slice_scatter), "select_scatter": picks(slice_scatter),
}
