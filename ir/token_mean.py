"""Losses that average over the targets a batch counts: cross-entropy with `ignore_index`, microbatched exactly.

`F.cross_entropy(logits, labels, ignore_index=-100)` (Hugging Face's own loss, padding marked -100) is a mean
over the targets that are not ignored, so a microbatch's loss divides by its own count. The mean of the
microbatches' losses is the batch's only when every microbatch counts as many targets; otherwise tokens of
a sparse microbatch weigh more (a Qwen2 with padded labels, float64, 1f1b, 4 microbatches: loss 4.17641 on
the pipeline against 4.17551 on one process, some grads 26 % off). Gradient accumulation in
`transformers` had the same bug and fixed it by dividing by the batch's count (`num_items_in_batch`).

`token_mean(g)` finds such losses in a traced graph: mean-reduced `cross_entropy_loss` / `nll_loss` ops on
the loss's path whose integer target comes from the batch. The loss is `exact` when it is one such mean times
constants (a view, a copy, `.mean()` of the scalar, a number or a constant tensor); a mean combined with other
terms, several means, or a class-weighted one (it divides by the sum of its targets' weights) are not. `counts(batch chunks)` runs the target's computation (the traced equations from the batch
to the target, no params) on each microbatch and counts the targets that are not ignored. With counts c_i of
N in all, weighting microbatch i's loss by c_i / N instead of 1 / microbatches gives the batch's mean exactly,
grads included (the engine's executor takes the weights: `engine/execution/step.py`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .core import Eqn, Graph, Literal, Var
from .evaluate import _read
from .purify import bound, resolve

__all__ = ["Target", "TokenMean", "token_mean"]

_MEAN = 1  # torch's Reduction::Mean
# ops that average over counted targets (their target, weight, reduction and ignore_index by schema name)
_LOSSES = ("aten.cross_entropy_loss.default", "aten.nll_loss.default", "aten.nll_loss_nd.default",
           "aten.nll_loss2d.default")
# ops that keep the loss a constant multiple of one such mean: `x` times, over or as numbers and constants
_SCALE = ("aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar", "aten.neg.default")
_SAME = ("aten.view.default", "aten.reshape.default", "aten.squeeze.default", "aten.squeeze.dim",
         "aten.unsqueeze.default", "aten.clone.default", "aten.alias.default", "aten._to_copy.default",
         "aten.to.dtype", "aten.mean.default", "aten.sum.default", "aten.mean.dim", "aten.sum.dim_IntList")


@attrs.frozen
class Target:
    """One counted mean's target, computed from the batch, and what it ignores."""

    eqns: tuple[Eqn, ...]        # from the batch inputs to `var`, in graph order (no params)
    var: Var
    ignore_index: int


@attrs.frozen
class TokenMean:
    """The counted means on the loss's path: how to compute their targets from the batch, and whether per-
    microbatch weights make the step exact (one mean, times constants) or not."""

    inputs: tuple[Var, ...]      # the graph's batch inputs, in order
    targets: tuple[Target, ...]
    exact: bool
    op: str                      # the first one's op, for messages
    weighted: bool = False       # a class-weighted mean (divides by a weight sum): no count makes it exact

    @property
    def ignore_index(self) -> int:
        return self.targets[0].ignore_index

    def counts(self, chunks: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        """[targets, microbatches]: per microbatch (its batch leaves, in order), the targets each mean counts
        (not its `ignore_index`); int64 on the batch's device, made without waiting for it."""
        rows = []
        with torch.no_grad():
            for t in self.targets:
                out = []
                for chunk in chunks:  # contiguous, as the executor hands a traced `view` its operands
                    env: dict[Var, Any] = {v: x.contiguous() for v, x in zip(self.inputs, chunk)}
                    for e in t.eqns:
                        res = resolve(e.op)(*_read(env, e.args), **{k: _read(env, v) for k, v in e.kwargs})
                        env.update((v, val) for v, val in zip(e.outputs, e.results(res)) if v is not None)
                    out.append((env[t.var] != t.ignore_index).sum())
                rows.append(torch.stack(out))
        return torch.stack(rows)


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


def _constants(g: Graph) -> set[Var]:
    """Values that read no graph input (`torch.tensor(0.5)` lifted into the graph)."""
    out: set[Var] = set()
    for e in g.eqns:
        if all(v in out for v in e.inputs):
            out.update(e.out_vars)
    return out


def _passes(e: Eqn, x: Var, constants: set[Var]) -> bool:
    """`e` makes a constant multiple, a copy, a view or the mean / sum of the scalar `x`."""
    others = [a for a in e.inputs if a is not x]
    if any(a not in constants for a in others) or x not in e.inputs:
        return False
    if e.op in _SAME:
        return e.args[0] is x and (e.op not in ("aten.mean.default", "aten.sum.default", "aten.mean.dim",
                                                "aten.sum.dim_IntList") or math.prod(x.aval.shape) == 1)
    return e.op in _SCALE and (not e.op.startswith("aten.div") or e.args[0] is x)


def _exact(g: Graph, loss: Eqn, made: dict[Var, Eqn]) -> bool:
    """Whether the graph's loss output is `loss`'s output times constants."""
    constants, v = _constants(g), g.outputs[0]
    while v is not loss.out_vars[0]:
        e = made.get(v)
        x = next((a for a in (e.inputs if e is not None else ()) if a not in constants), None)
        if e is None or x is None or not _passes(e, x, constants):
            return False
        v = x
    return True


def _target(g: Graph, e: Eqn, arg: dict[str, Any], made: dict[Var, Eqn]) -> Target | None:
    target = arg["target"]
    if not isinstance(target, Var) or target.aval.dtype not in (torch.int64, torch.int32, torch.uint8):
        return None  # class probabilities: every row counts
    found = _ancestors(g, target, made)
    if found is None or not found[1] <= set(g.inputs[g.num_params:]):
        return None  # a target that is not computed from the batch alone
    return Target(tuple(found[0]), target, int(_value(arg["ignore_index"])))


def token_mean(g: Graph) -> TokenMean | None:
    """The counted means feeding the graph's loss output (see above); None when there is none."""
    made = _producers(g)
    on_path = _ancestors_any(g, g.outputs[0], made)
    found: list[tuple[Eqn, Target]] = []
    weighted = False
    for e in g.eqns:
        if e.op not in _LOSSES or id(e) not in on_path:
            continue
        arg = bound(e)
        if _value(arg["reduction"]) != _MEAN:
            continue
        t = _target(g, e, arg, made)
        if t is None:
            continue
        weighted = weighted or arg.get("weight") is not None  # a mean over sum(weight[target]), not a count
        found.append((e, t))
    if not found:
        return None
    exact = len(found) == 1 and not weighted and _exact(g, found[0][0], made)
    return TokenMean(tuple(g.inputs[g.num_params:]), tuple(t for _, t in found), exact, found[0][0].op, weighted)


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
