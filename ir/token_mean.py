"""Losses that average over the targets a batch counts: cross-entropy with `ignore_index`, microbatched exactly.

`F.cross_entropy(logits, labels, ignore_index=-100)` (Hugging Face's own loss, padding marked -100) is a mean
over the targets that are not ignored, so a microbatch's loss divides by its own count. The mean of the
microbatches' losses is the batch's only when every microbatch counts as many targets; otherwise tokens of
a sparse microbatch weigh more (a Qwen2 with padded labels, float64, 1f1b, 4 microbatches: loss 4.17641 on
the pipeline against 4.17551 on one process, some grads 26 % off). Gradient accumulation in
`transformers` had the same bug and fixed it by dividing by the batch's count (`num_items_in_batch`).

`token_mean(g)` finds such a loss in a traced graph: the loss output is a mean-reduced `cross_entropy_loss`
or `nll_loss` whose target comes from the batch, times constants (`exact`), or such a mean combined with other
terms (not exact). `counts(batch chunks)` runs the target's computation (the traced equations from the batch
to the target, no params) on each microbatch and counts the targets that are not ignored. With counts c_i of
N in all, weighting microbatch i's loss by c_i / N instead of 1 / microbatches gives the batch's mean exactly,
grads included (the engine's executor takes the weights: `engine/execution/step.py`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .core import Eqn, Graph, Literal, Var
from .evaluate import _read
from .purify import resolve

__all__ = ["TokenMean", "token_mean"]

_MEAN = 1  # torch's Reduction::Mean
# ops that average over counted targets -> the names of their target, weight, reduction and ignore_index arguments
_LOSSES = ("aten.cross_entropy_loss.default", "aten.nll_loss.default", "aten.nll_loss_nd.default",
           "aten.nll_loss2d.default")
# ops that keep the loss a constant multiple of one such mean (x, then a number or nothing)
_AFFINE = ("aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar", "aten.view.default",
           "aten.reshape.default", "aten.squeeze.default", "aten.clone.default", "aten.alias.default",
           "aten._to_copy.default", "aten.to.dtype", "aten.neg.default", "aten.detach.default")


@attrs.frozen
class TokenMean:
    """The loss's mean over counted targets: how to compute its target from the batch, and what it ignores."""

    eqns: tuple[Eqn, ...]        # from the batch inputs to `target`, in graph order (no params)
    inputs: tuple[Var, ...]      # the graph's batch inputs, in order
    target: Var
    ignore_index: int
    exact: bool                  # the loss is this mean times constants: per-microbatch weights make it exact
    op: str

    def counts(self, chunks: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """Per microbatch (its batch leaves, in order), the targets that count (not `ignore_index`): an int64
        tensor on the batch's device, made without waiting for it (a batch on a GPU is not synchronized)."""
        out = []
        with torch.no_grad():
            for chunk in chunks:
                env: dict[Var, Any] = dict(zip(self.inputs, chunk))
                for e in self.eqns:
                    res = resolve(e.op)(*_read(env, e.args), **{k: _read(env, v) for k, v in e.kwargs})
                    env.update((v, val) for v, val in zip(e.outputs, e.results(res)) if v is not None)
                out.append((env[self.target] != self.ignore_index).sum())
        return torch.stack(out)


def _bound(e: Eqn) -> dict[str, Any]:
    """The op's arguments by name, defaults filled in."""
    schema = resolve(e.op)._schema.arguments
    named = dict(zip((a.name for a in schema), e.args))
    named.update(e.kwargs)
    return {a.name: named.get(a.name, a.default_value if a.has_default_value() else None) for a in schema}


def _value(x: Any) -> Any:
    return x.value if isinstance(x, Literal) else x


def _producers(g: Graph) -> dict[Var, Eqn]:
    return {v: e for e in g.eqns for v in e.out_vars}


def _ancestors(g: Graph, v: Var, made: dict[Var, Eqn]) -> tuple[list[Eqn], set[Var]] | None:
    """The equations that compute `v` and the graph inputs they read; None when a param is among them."""
    params = set(g.params)
    seen: set[int] = set()
    found, leaves, stack = [], set(), [v]
    while stack:
        x = stack.pop()
        if x in params:
            return None
        e = made.get(x)
        if e is None:
            leaves.add(x)
            continue
        if id(e) not in seen:
            seen.add(id(e))
            found.append(e)
            stack.extend(e.inputs)
    order = {id(e): i for i, e in enumerate(g.eqns)}
    return sorted(found, key=lambda e: order[id(e)]), leaves


def _is_constant_factor(e: Eqn, x: Var) -> bool:
    """`e` makes a constant multiple (or a copy or view) of `x`: its other operands are numbers."""
    others = [a for a in e.args[1:] if isinstance(a, Var)]
    return e.op in _AFFINE and e.args and e.args[0] is x and not others


def _exact(g: Graph, loss: Eqn, made: dict[Var, Eqn]) -> bool:
    """Whether the graph's loss output is `loss`'s output times constants."""
    v = g.outputs[0]
    while v is not loss.out_vars[0]:
        e = made.get(v)
        if e is None or not isinstance(e.args[0], Var) or not _is_constant_factor(e, e.args[0]):
            return False
        v = e.args[0]
    return True


def token_mean(g: Graph) -> TokenMean | None:
    """The mean-over-counted-targets loss feeding the graph's loss output, if there is one (see above);
    None when the loss has none, or when its target is not computed from the batch alone."""
    made = _producers(g)
    on_path = _ancestors_any(g, g.outputs[0], made)
    for e in g.eqns:
        if e.op not in _LOSSES or id(e) not in on_path:
            continue
        arg = _bound(e)
        if _value(arg["reduction"]) != _MEAN or arg.get("weight") is not None:
            continue  # a class-weighted mean divides by a weight sum: not handled here (see engine.execution.step)
        target = arg["target"] if "target" in arg else e.args[1]
        if not isinstance(target, Var) or not target.aval.dtype in (torch.int64, torch.int32, torch.uint8):
            continue  # class probabilities: every row counts
        found = _ancestors(g, target, made)
        if found is None:
            continue
        eqns, leaves = found
        batch = tuple(g.inputs[g.num_params:])
        if not leaves <= set(batch):
            continue
        return TokenMean(tuple(eqns), batch, target, int(_value(arg["ignore_index"])), _exact(g, e, made), e.op)
    return None


def _ancestors_any(g: Graph, v: Var, made: dict[Var, Eqn]) -> set[int]:
    """ids of every equation the value `v` depends on (params allowed)."""
    seen: set[int] = set()
    stack = [v]
    while stack:
        e = made.get(stack.pop())
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            stack.extend(e.inputs)
    return seen
