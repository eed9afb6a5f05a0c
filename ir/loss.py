"""The loss contract of a traced graph: one floating-point scalar that depends on the params, then aux leaves."""
from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

from .core import Graph, Literal, Var
from .errors import TraceError
from .trace import key_name

CONTRACT = ("the loss function must return one floating-point scalar tensor (0-dim: a mean over the batch) that "
            "depends on the params")
AUX_FIX = ("to return auxiliary values too, pass has_aux=True and return (loss, aux), aux a pytree of float "
           "tensors; step(...) then returns ((loss, aux), grads)")


def children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """A tree spec's children (`children()` where torch has it, `children_specs` before)."""
    return list(spec.children()) if callable(getattr(spec, "children", None)) else list(spec.children_specs)


def aux_names(g: Graph) -> tuple[str, ...]:
    """Names of the aux leaves of a graph traced from a `(loss, aux)` function: `aux`, `aux.acc`, `aux.0`."""
    if g.out_tree is None or g.out_tree.is_leaf():
        return ()
    spec = children(g.out_tree)[1]
    paths = pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * spec.num_leaves, spec))[0]
    return tuple(".".join(x for x in ("aux", key_name(p)) if x) for p, _ in paths)


def returns_aux(g: Graph) -> bool:
    """Whether the graph's function returns `(loss, aux)` (its outputs are the loss, then the aux leaves)."""
    return g.out_tree is not None and not g.out_tree.is_leaf()


def _shape(spec: Any) -> str:
    kind = spec.type.__name__ if spec.type is not None else "leaf"
    return f"a {kind} of {spec.num_leaves} tensor{'s' if spec.num_leaves != 1 else ''}"


def _from_params(g: Graph) -> set[Var]:
    """Values computed from a param through ops a gradient can flow through (not `detach`)."""
    reach = set(g.params)
    for e in g.eqns:
        if e.op != "aten.detach.default" and any(v in reach for v in e.inputs):
            reach.update(e.out_vars)
    return reach


def _check_structure(g: Graph, name: str, aux: bool) -> None:
    spec = g.out_tree
    if spec is None:
        return
    if aux and (spec.is_leaf() or spec.num_children != 2 or not children(spec)[0].is_leaf()):
        got = "a single tensor" if spec.is_leaf() else _shape(spec)
        raise TraceError(f"{name} returns {got}, but has_aux=True asks for a pair (loss, aux): the loss a "
                         "floating-point scalar tensor, aux a pytree of float tensors; return (loss, aux), or "
                         "drop has_aux")
    if not aux and not spec.is_leaf():
        got = ", ".join(str(v.aval) if isinstance(v, Var) else str(v) for v in g.outputs)
        raise TraceError(f"{name} returns {_shape(spec)} ({got}); {CONTRACT}. {AUX_FIX[0].upper()}{AUX_FIX[1:]}")


def _traced_on(g: Graph) -> str:
    """` (traced on a microbatch of 16 rows)`, so that a per-example shape reads as one."""
    rows = {v.aval.shape[0] for v in g.batch if v.aval.shape}
    return f" (traced on a microbatch of {rows.pop()} rows)" if len(rows) == 1 else ""


def _check_loss_value(g: Graph, name: str) -> None:
    loss = g.outputs[0]
    if isinstance(loss, Literal) or not isinstance(loss, Var):
        raise TraceError(f"{name} returns the constant {loss} as its loss; {CONTRACT}")
    if loss in set(g.inputs):
        raise TraceError(f"{name} returns its input '{g.input_names[g.inputs.index(loss)]}' unchanged as the loss; "
                         f"{CONTRACT}")
    if loss.aval.shape != ():
        raise TraceError(f"{name} returns a loss of shape {loss.aval}{_traced_on(g)}, not a scalar; {CONTRACT}: "
                         "reduce it over the batch, e.g. `.mean()`")
    if not loss.aval.dtype.is_floating_point:
        raise TraceError(f"{name} returns a loss of type {loss.aval}; {CONTRACT}: an integer or bool value has no "
                         "gradient; compute the loss in floating point")
    if loss not in _from_params(g):
        raise TraceError(f"{name}'s loss does not depend on any param (it is computed from the batch alone, or "
                         f"through detach), so every grad would be zero; {CONTRACT}")


def _check_aux(g: Graph, name: str) -> None:
    inputs = dict(zip(g.inputs, g.input_names))
    for leaf, v in zip(aux_names(g), g.outputs[1:]):
        if not isinstance(v, Var):
            raise TraceError(f"{name} returns the constant {v} as '{leaf}'; aux leaves must be tensors computed "
                             "by the function")
        if v in inputs:
            raise TraceError(f"{name} returns its input '{inputs[v]}' unchanged as '{leaf}'; return a value "
                             f"computed from it instead (e.g. `.detach()` of it)")
        if not v.aval.dtype.is_floating_point:
            raise TraceError(f"{name} returns '{leaf}' as {v.aval}; aux leaves are averaged over the "
                             "microbatches like the loss, so they must be floating-point: `.float()` a count "
                             "(its average is then the mean over the batch)")


def check_loss(g: Graph, *, has_aux: bool = False, name: str = "loss_fn") -> Graph:
    """`g` if it is a loss: one floating-point scalar (0-dim) that depends on a param through ops a gradient
    flows through; with `has_aux`, the function returns `(loss, aux)` and every aux leaf is a floating-point
    tensor it computed. Raises TraceError saying what the contract is and what `g` returns otherwise."""
    _check_structure(g, name, has_aux)
    _check_loss_value(g, name)
    if has_aux:
        _check_aux(g, name)
    return g
