"""How each op moves the batch's rows (`ir.batch_rows`): elementwise ops, views, reductions, norms and losses.

`RULES` maps an op (`aten.softmax.int`) or its name (`softmax`) to a rule `(Ctx) -> [Rows per output]`; the
indexing and contraction rules live in `ir/batch_index.py` and `ir/batch_contract.py` and join the table here.
A rule returns the outputs' states or raises `Mixes`; an op without a rule makes its outputs unknown.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .batch_contract import CONTRACT_RULES
from .batch_index import INDEX_RULES
from .batch_state import CLEAN, UNKNOWN, Ctx, Mixes, Rows, Rule, agree, norm_dim, reshaped, rows, shape_of, summed
from .purify import resolve

__all__ = ["KEEPS_IOTA", "RULES", "rule_of"]


# --------------------------------------------------------------------------- elementwise


def _linear_mul(c: Ctx) -> bool:
    return sum(not c.state(x).clean for x in c.tensors()) <= 1


def _clean_at(*names: str) -> Callable[[Ctx], bool]:
    return lambda c: all(c.state(c.arg(n)).clean for n in names)


# elementwise ops that keep a sum over rows one (a linear function of the per-microbatch values, so the mean
# over microbatches commutes with them); every other elementwise op of such a sum mixes rows
_LINEAR: dict[str, Callable[[Ctx], bool]] = {
    **{op: (lambda c: True) for op in ("add", "sub", "rsub", "neg", "positive", "clone", "alias", "detach",
                                      "contiguous", "_to_copy", "to", "type_as", "lift_fresh_copy",
                                      "_unsafe_view", "real", "conj", "resolve_conj", "resolve_neg")},
    "mul": _linear_mul, "div": _clean_at("other"), "true_divide": _clean_at("other"),
    "where": _clean_at("condition"), "masked_fill": _clean_at("mask", "value"), "lerp": _clean_at("weight"),
    "addcmul": lambda c: c.state(c.arg("tensor1")).clean or c.state(c.arg("tensor2")).clean,
    "addcdiv": _clean_at("tensor2"),
}


def _placed(c: Ctx, ndim: int) -> list[tuple[int, int]]:
    """Where each operand's rows land in a broadcast output of `ndim` dims (aligned from the right)."""
    return [(s.dim + ndim - len(shape_of(x)), s.inner) for x in c.tensors() if (s := c.state(x)).rows]


def pointwise(c: Ctx) -> list[Rows]:
    """Broadcasting elementwise ops: rows in one output dim pass; two dims pair rows; a row beside a sum over
    rows, or a sum over rows through a non-linear op, mixes them."""
    ndim = len(c.out_shape())
    placed = agree(_placed(c, ndim))
    states = [c.state(x) for x in c.tensors()]
    if any(s.unknown for s in states):
        return c.outputs(UNKNOWN)
    sums = [s for s in states if s.summed]
    if not sums:
        return c.outputs(c.checked(placed, c.out_shape()))
    if placed.rows:
        raise Mixes(f"combines each row of the batch with a sum or mean over all of its rows (made by "
                    f"`{sums[0].origin}`): {c.op} of a row and the batch's aggregate")
    linear = c.op in _LINEAR and _LINEAR[c.op](c)
    if len(sums) > 1 and not linear:
        ratio = (": a ratio of sums, such as a mean over counted targets (cross_entropy with ignore_index and "
                 "reduction='mean' is one fnpipe weights exactly)") if c.op in ("div", "true_divide") else \
            " (a load-balancing loss)"
        raise Mixes(f"combines {len(sums)} sums or means over the batch's rows (made by "
                    f"{' and '.join(f'`{s.origin}`' for s in sums)}) non-linearly, so the mean of each microbatch's "
                    f"result is not the result of the batch's means{ratio}")
    if not linear:
        raise Mixes(f"applies the non-linear `{c.op}` to a sum or mean over the batch's rows (made by "
                    f"`{sums[0].origin}`): the mean of each microbatch's result is not the batch's")
    return c.outputs(sums[0])


def same(c: Ctx) -> list[Rows]:
    """Copies, casts and aliases: the first operand's state."""
    return c.outputs(c.state(c.first))


def fresh(c: Ctx) -> list[Rows]:
    """`zeros_like`, `new_ones`, ...: values that read only their operand's shape."""
    return c.outputs(CLEAN)


def copied(c: Ctx) -> list[Rows]:
    """`copy(self, src)`: src's values, broadcast to self's shape (self's own are overwritten)."""
    src = c.arg("src")
    s, shift = c.state(src), len(c.out_shape()) - len(shape_of(src))
    return c.outputs(c.checked(rows(s.dim + shift, s.inner), c.out_shape()) if s.rows else s)


def fill(c: Ctx) -> list[Rows]:
    """`fill(self, value)`: the value's state, everywhere."""
    return c.outputs(c.state(c.arg("value")))


# --------------------------------------------------------------------------- views


def view(c: Ctx) -> list[Rows]:
    """Row-major reshapes (view, reshape, flatten, unflatten, squeeze, unsqueeze)."""
    x = c.first
    return c.outputs(reshaped(c.state(x), shape_of(x), c.out_shape(), c.m))


def permuted(c: Ctx) -> list[Rows]:
    """permute, transpose, t, movedim...: where dim d went, found by running the op on a meta tensor whose
    dim k has size k + 1."""
    x = c.first
    s = c.state(x)
    if not s.rows:
        return c.outputs(s if not s.clean else CLEAN)  # an iota's dim is not followed through a permutation
    probe = torch.empty([k + 1 for k in range(len(shape_of(x)))], device="meta")
    args = [probe if a is x else a for a in c.eqn.args]
    out = resolve(c.eqn.op)(*args, **dict(c.eqn.kwargs))
    return c.outputs(c.checked(rows(list(out.shape).index(s.dim + 1), s.inner), c.out_shape()))


def expand(c: Ctx) -> list[Rows]:
    """Broadcast to a larger shape: rows (or an iota's dim) move by the dims added in front."""
    x = c.first
    s = c.state(x)
    shift = len(c.out_shape()) - len(shape_of(x))
    if s.iota:
        return c.outputs(Rows("clean", s.dim + shift, iota=True))
    return c.outputs(c.checked(rows(s.dim + shift, s.inner), c.out_shape()) if s.rows else s)


def broadcast_tensors(c: Ctx) -> list[Rows]:
    """Each operand expanded to the common shape (output k is operand k)."""
    out = []
    for k, (x, v) in enumerate(zip(c.arg("tensors"), c.eqn.outputs)):
        s, shift = c.state(x), len(c.out_shape(k)) - len(shape_of(x))
        out.append(Rows(s.kind, s.dim + shift, s.inner, s.iota, s.origin) if s.rows or s.iota else s)
    return [c.checked(s, c.out_shape(k)) for k, s in enumerate(out)]


# --------------------------------------------------------------------------- reductions


def _reduced(c: Ctx, ndim: int) -> list[int]:
    """The dims an op reduces: its `dim` argument, or every dim where it has none (or None, or [])."""
    dim = c.arg("dim") if c.has("dim") else None
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({norm_dim(int(d), max(ndim, 1)) for d in dims})


def _keepdim(c: Ctx) -> bool:
    return bool(c.arg("keepdim")) if c.has("keepdim") else False


def reduction(linear: bool) -> Rule:
    """sum / mean (linear: a reduction over the rows is a sum over them) and amax, var, logsumexp, norm...
    (not: over the rows they mix them)."""
    def rule(c: Ctx) -> list[Rows]:
        x = c.first
        s, ndim = c.state(x), len(shape_of(x))
        dims = _reduced(c, ndim)
        if s.summed and not linear:
            raise Mixes(f"takes the non-linear `{c.op}` of a sum or mean over the batch's rows (made by `{s.origin}`)")
        if not s.rows:
            return c.outputs(s)
        if s.dim not in dims:
            at = s.dim if _keepdim(c) else s.dim - sum(d < s.dim for d in dims)
            return c.outputs(c.checked(rows(at, s.inner), c.out_shape()))
        if not linear:
            raise Mixes(f"takes `{c.op}` over dim {s.dim}, which carries the batch's rows: the result of each "
                        "microbatch is not a part of the batch's")
        return c.outputs(summed(c.op))
    return rule


def along(linear: bool = False) -> Rule:
    """softmax, cumsum, sort, topk, diff...: each output depends on the whole of its `dim`."""
    def rule(c: Ctx) -> list[Rows]:
        x = c.first
        s = c.state(x)
        if any(not c.state(v).clean for v in c.tensors() if v is not x):  # diff's prepend / append
            return c.outputs(UNKNOWN)
        if s.summed and not linear:
            raise Mixes(f"takes the non-linear `{c.op}` of a sum or mean over the batch's rows (made by `{s.origin}`)")
        dim = c.arg("dim") if c.op != "msort" else 0
        if s.rows and norm_dim(int(dim), len(shape_of(x))) == s.dim:
            raise Mixes(f"takes `{c.op}` along dim {s.dim}, which carries the batch's rows: each row's result "
                        "depends on the other rows")
        return c.outputs(c.checked(s, c.out_shape()) if s.rows else s)
    return rule


def counted(c: Ctx) -> list[Rows]:
    """histc / bincount: a count over every element, so over the rows a sum of per-row counts."""
    s = c.state(c.first)
    if s.summed:
        raise Mixes(f"counts values of a sum or mean over the batch's rows (made by `{s.origin}`)")
    return c.outputs(summed(c.op) if s.rows else s)


# --------------------------------------------------------------------------- norms


def trailing_norm(c: Ctx) -> list[Rows]:
    """layer_norm / rms_norm: statistics over the last len(normalized_shape) dims of each row."""
    x = c.arg("input")
    s, ndim = c.state(x), len(shape_of(x))
    if any(not c.state(c.arg(n)).clean for n in ("weight", "bias") if c.has(n)):
        return c.outputs(UNKNOWN)
    if s.rows and s.dim >= ndim - len(c.arg("normalized_shape")):
        raise Mixes(f"normalises over dim {s.dim}, which carries the batch's rows: each row's statistics "
                    "include the other rows")
    return c.outputs(s)


def batch_norm(c: Ctx) -> list[Rows]:
    """BatchNorm: in eval mode a per-channel affine map. In train mode each row is normalised with statistics
    over the batch's rows: the engine's own business for the modules `engine.functionalize` made (each
    microbatch normalised with its own, engine/training/batchnorm.py: `own_norms`), so the output keeps its
    rows and the statistics count as constants; in any other function (`F.batch_norm(..., training=True)`
    written by hand) a mix, as `x - x.mean(0)` is."""
    s = c.state(c.arg("input"))
    training = bool(c.arg("training")) if c.has("training") else False
    if training and s.rows and s.dim == 0 and not c.own_norms:
        raise Mixes("normalises each row with statistics over all the batch's rows (train-mode batch norm "
                    "outside engine.functionalize, whose modules' BatchNorm the engine runs per microbatch)")
    if s.summed or (s.rows and s.dim not in ((0,) if training else (0, 1))):
        return c.outputs(UNKNOWN)
    return [s] + [CLEAN] * (len(c.eqn.outputs) - 1)


def sample_norm(c: Ctx) -> list[Rows]:
    """group_norm / instance_norm: statistics per sample (dim 0); rows elsewhere are not followed."""
    s = c.state(c.arg("input"))
    return c.outputs(s if s.clean or (s.rows and s.dim == 0) else UNKNOWN)


# --------------------------------------------------------------------------- losses


def class_loss(c: Ctx) -> list[Rows]:
    """cross_entropy / nll_loss: input [N, C, d...] (or [C]) with class indices [N, d...] or probabilities
    like the input. Rows in the class dim are scored against each other (CLIP's logits); the reduction
    (mean or sum) of rows is a sum over them."""
    x, y = c.arg("self"), c.arg("target")
    sx, sy, ndim = c.state(x), c.state(y), len(shape_of(x))
    if not c.state(c.arg("weight")).clean or sx.unknown or sy.unknown:
        return c.outputs(UNKNOWN)
    if sx.summed or sy.summed:
        raise Mixes(f"takes `{c.op}` of a sum or mean over the batch's rows")
    classes = 1 if ndim >= 2 else 0
    if sx.rows and sx.dim == classes:
        raise Mixes(f"takes `{c.op}` over the classes in dim {classes}, which carries the batch's rows: every "
                    "row is scored against the other rows (a contrastive loss)")
    probs = len(shape_of(y)) == ndim  # class probabilities, shaped like the input
    if sy.rows and probs and sy.dim == classes:
        return c.outputs(UNKNOWN)
    found = [(sx.dim - (sx.dim > classes), sx.inner)] if sx.rows else []
    if sy.rows:
        found.append((sy.dim - (sy.dim > classes) if probs else sy.dim, sy.inner))
    return _reduced_loss(c, agree(found))


def _reduced_loss(c: Ctx, placed: Rows) -> list[Rows]:
    if int(c.arg("reduction")) == 0:  # none: the per-element losses
        return c.outputs(c.checked(placed, c.out_shape()))
    return c.outputs(summed(c.op) if placed.rows else placed)


def elementwise_loss(c: Ctx) -> list[Rows]:
    """mse, l1, smooth_l1, huber, binary cross-entropy, kl_div...: elementwise, then reduced (mean or sum)."""
    ndim = max(len(shape_of(x)) for x in c.tensors())
    if any(c.state(x).unknown for x in c.tensors()):
        return c.outputs(UNKNOWN)
    if any(c.state(x).summed for x in c.tensors()):
        raise Mixes(f"takes `{c.op}` of a sum or mean over the batch's rows")
    return _reduced_loss(c, agree(_placed(c, ndim)))


# --------------------------------------------------------------------------- composites that pair rows
# ir.trace keeps CompositeImplicitAutograd ops whole; these are the ones contrastive losses are written with.


def _last_dim(c: Ctx, ndim: int) -> int:
    return ndim - 1


def _dim_arg(c: Ctx, ndim: int) -> int:
    return norm_dim(int(c.arg("dim")), ndim)


def broadcast_reduced(dim_of: Callable[[Ctx, int], int]) -> Rule:
    """cosine_similarity (over `dim`) / pairwise_distance (over the last dim): elementwise over the broadcast
    operands, then a non-linear reduction of one dim. Rows in two dims pair them (SimCLR's
    `cosine_similarity(z[:, None], z[None], dim=-1)`); a reduction over the rows' dim mixes them."""
    def rule(c: Ctx) -> list[Rows]:
        states = [c.state(x) for x in c.tensors()]
        if any(s.unknown for s in states):
            return c.outputs(UNKNOWN)
        if any(s.summed for s in states):
            raise Mixes(f"takes `{c.op}` of a sum or mean over the batch's rows")
        ndim = max(len(shape_of(x)) for x in c.tensors())
        placed = agree(_placed(c, ndim))
        if not placed.rows:
            return c.outputs(placed)
        d = dim_of(c, ndim)
        if placed.dim == d:
            raise Mixes(f"takes `{c.op}` over dim {d}, which carries the batch's rows")
        kept = _keepdim(c) and len(c.out_shape()) == ndim
        return c.outputs(c.checked(rows(placed.dim - (placed.dim > d and not kept), placed.inner), c.out_shape()))
    return rule


def pdist(c: Ctx) -> list[Rows]:
    """pdist(x [N, M]): the distance of every pair of x's rows (dim 0)."""
    s = c.state(c.first)
    if s.rows and s.dim == 0:
        raise Mixes("pairs the batch's rows: every row's distance to every other")
    return c.outputs(UNKNOWN if s.rows or s.summed else s)


def outer(c: Ctx) -> list[Rows]:
    """outer / ger (a [n], b [k] -> [n, k]): a's rows in dim 0, b's in dim 1 (both: every row against every
    other)."""
    sa, sb = (c.state(x) for x in c.eqn.args[:2])
    if sa.unknown or sb.unknown or sa.summed or sb.summed:
        return c.outputs(UNKNOWN)
    placed = agree([(0, sa.inner)] * sa.rows + [(1, sb.inner)] * sb.rows)
    return c.outputs(c.checked(placed, c.out_shape()))


# --------------------------------------------------------------------------- the table

_POINTWISE_EXTRA = ("__and__", "__or__", "__xor__", "__lshift__", "__rshift__", "where", "bitwise_and", "bitwise_or",
                    "logical_and", "logical_or", "logical_xor", "masked_fill", "clamp", "clamp_min",
                    "clamp_max", "nan_to_num", "dropout")
_SAME = ("clone", "alias", "detach", "contiguous", "_to_copy", "to", "type_as", "lift_fresh_copy",
         "lift_fresh", "_conj", "conj", "resolve_conj", "resolve_neg", "positive", "alias_copy", "detach_copy",
         "view_as_real", "view_as_complex", "_assert_tensor_metadata")
_FRESH = ("zeros_like", "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full",
          "new_empty_strided", "empty_strided", "rand_like", "randn_like", "randint_like", "_shape_as_tensor")
_VIEWS = ("view", "reshape", "_unsafe_view", "_reshape_alias", "flatten", "unflatten", "squeeze", "unsqueeze",
          "view_as", "reshape_as", "view_copy", "squeeze_copy", "unsqueeze_copy")
_PERMUTES = ("permute", "transpose", "t", "numpy_T", "movedim", "moveaxis", "swapaxes", "swapdims", "mT", "mH",
             "adjoint", "permute_copy", "transpose_copy", "t_copy")
_LINEAR_REDUCE = ("sum", "mean", "nansum", "nanmean", "count_nonzero")
_NONLINEAR_REDUCE = ("amax", "amin", "max", "min", "aminmax", "argmax", "argmin", "prod", "std", "var", "std_mean",
                     "var_mean", "logsumexp", "norm", "linalg_vector_norm", "frobenius_norm", "all", "any",
                     "median", "nanmedian", "mode", "kthvalue")
_ALONG = ("softmax", "log_softmax", "_softmax", "_log_softmax", "special_softmax", "special_log_softmax", "cumprod",
          "cummax", "cummin", "logcumsumexp", "sort", "argsort", "msort", "topk", "_safe_softmax")
_ELEMENTWISE_LOSSES = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                       "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "poisson_nll_loss",
                       "hinge_embedding_loss", "margin_ranking_loss")

RULES: dict[str, Rule] = {
    **{op: pointwise for op in _POINTWISE_EXTRA}, **{op: same for op in _SAME}, **{op: fresh for op in _FRESH},
    **{op: view for op in _VIEWS}, **{op: permuted for op in _PERMUTES},
    "expand": expand, "expand_as": expand, "broadcast_to": expand, "expand_copy": expand,
    "broadcast_tensors": broadcast_tensors, "copy": copied, "_copy_from": copied, "fill": fill,
    **{op: reduction(True) for op in _LINEAR_REDUCE}, **{op: reduction(False) for op in _NONLINEAR_REDUCE},
    "max.other": pointwise, "min.other": pointwise,  # elementwise maximum / minimum of two tensors
    **{op: along() for op in _ALONG}, "cumsum": along(linear=True), "diff": along(linear=True),
    "histc": counted, "bincount": counted,
    "layer_norm": trailing_norm, "native_layer_norm": trailing_norm, "rms_norm": trailing_norm,
    "_fused_rms_norm": trailing_norm,
    **{op: batch_norm for op in ("batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                                 "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
                                 "_batch_norm_impl_index", "_batch_norm_with_update",
                                 "_batch_norm_with_update_functional", "_batch_norm_no_update")},
    "group_norm": sample_norm, "native_group_norm": sample_norm, "instance_norm": sample_norm,
    "cosine_similarity": broadcast_reduced(_dim_arg), "pairwise_distance": broadcast_reduced(_last_dim),
    "pdist": pdist, "_pdist_forward": pdist, "outer": outer, "ger": outer,
    "cross_entropy_loss": class_loss, "nll_loss": class_loss, "nll_loss_nd": class_loss, "nll_loss2d": class_loss,
    **{op: elementwise_loss for op in _ELEMENTWISE_LOSSES},
    **INDEX_RULES, **CONTRACT_RULES,
}


# the rules an iota goes through (any other op of clean values gives a clean value)
KEEPS_IOTA = (same, view, expand, broadcast_tensors)


def rule_of(op: str) -> Rule | None:
    """The rule of `aten.name.overload`: by the op, by its name, or `pointwise` for an op PyTorch tags
    pointwise (elementwise with broadcasting); None for an op no rule knows."""
    name, overload = op.removeprefix("aten.").rsplit(".", 1) if op.startswith("aten.") else (op, "")
    found = RULES.get(f"{name}.{overload}") or RULES.get(name)
    if found is not None:
        return found
    try:
        return pointwise if torch.Tag.pointwise in resolve(op).tags else None
    except (AttributeError, ValueError):
        return None

