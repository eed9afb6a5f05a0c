"""`ir.batch_rows`: which dim of each value carries the batch's rows, and the ops that mix rows with each other.

fnpipe cuts every batch input along dim 0 into microbatches (and data-parallel shares), runs the function on
each and averages their losses. That is the batch's loss when the loss is a mean of per-row terms (or a sum,
scaled), and not when it compares rows: CLIP's contrastive loss scores every image against every text
of the batch ([B, B] logits), Mixtral's router balance multiplies two means over all tokens. The walk
follows, op by op, where the rows are (`ir/batch_state.py`: clean, rows in one dim, a sum over rows,
unknown) and finds the first op on the path of an output that mixes them:

- an output with rows in two dims (`a @ b.T`, `x[:, None] - y[None]`): every row against every other;
- a sum over one operand's rows for each row of another (`softmax(a @ b.T) @ b`);
- softmax, cumsum, sort, topk, layer_norm, amax, var, logsumexp... along or over the rows' dim;
- a row combined with a sum over the batch's rows (`x - x.mean(0)`), or a non-linear function of such
  sums (`mean_a * mean_b`, `log(x.mean(0))`, a ratio of two means).

Allowed as the engine allows them: sums and means over rows (the loss's reduction, a cross-entropy's mean,
its `ignore_index` count weighted by `ir.token_mean`), and anything linear after them (scaled, added to a
regulariser of the params or to another such mean). BatchNorm's train-mode statistics are the engine's own
in the modules `engine.functionalize` made (each microbatch normalised with its own,
engine/training/batchnorm.py: `own_norms`), whose output keeps its rows; written by hand
(`F.batch_norm(..., training=True)`) they mix rows. Only the loss's path is refused (`mixed_rows`): an aux
leaf is averaged over the parts, and the engine warns when one mixes rows.

Soundness, and where the walk is conservative. Each rule is exact for the ops it knows, given m >= 2 rows
(a graph traced with one row cannot tell the rows' dim from any other dim of size 1: trace with two).
An op no rule knows makes its outputs unknown when it reads the batch, and clean otherwise; unknown
spreads and is never refused: the walk refuses only what it can show. So it misses mixes that pass
through an op it does not know (scatter, index_put, unfold, custom ops), through rows picked by a
constant or by the data (`x[1:] - x[:-1]`, `x.roll(1, 0)`, `x[perm]`: unknown), and linear mixes against a
constant (`ones(B) @ x` or a weighted sum over rows by position counts as a sum). A sum over rows
combined linearly with a row is refused although a later sum over rows would make it exact
(`(x + x.mean(0)).mean()`): such losses are not written in practice.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from .autodiff import _ancestors
from .batch_rules import KEEPS_IOTA, rule_of
from .batch_state import CLEAN, IOTA, UNKNOWN, Ctx, Mixes, Rows, rows, short
from .core import Eqn, Graph, Literal, Var

__all__ = ["MixedRows", "batch_rows", "mixed_rows"]

log = logging.getLogger("ir.batch_rows")


@attrs.frozen
class MixedRows:
    """An op whose output mixes rows of the batch with each other, and how."""

    index: int          # the equation, in graph order
    op: str
    why: str
    operands: str       # `f64[8,16], f64[16,8] -> f64[8,8]`
    source: str = ""    # the line that called it, when the graph records it

    def __str__(self) -> str:
        where = f"\n  at {self.source}" if self.source else ""
        return f"`{short(self.op)}` (equation {self.index}: {self.operands}) {self.why}{where}"


def row_count(g: Graph) -> int | None:
    """m: the rows of the graph's batch inputs (dim 0, the dim the engine cuts); None without batch inputs."""
    sizes = [v.aval.shape[0] for v in g.batch if v.aval.shape]
    return sizes[0] if sizes else None


def _iota(e: Eqn) -> bool:
    """`arange(n)` (start 0, step 1): an index that maps each position to itself."""
    if not e.op.startswith("aten.arange."):
        return False
    args = [a.value if isinstance(a, Literal) else a for a in e.args]
    kw = dict(e.kwargs)
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else kw.get("step", 1))
    return start == 0 and step == 1


def _step(e: Eqn, m: int, states: dict[Var, Rows], own_norms: bool = False) -> list[Rows]:
    """The states of `e`'s outputs; `Mixes` when it mixes rows."""
    rule = rule_of(e.op)
    ins = [states.get(v, UNKNOWN) for v in e.inputs]
    if all(s.clean for s in ins) and not (rule in KEEPS_IOTA and any(s.iota for s in ins)):
        return [IOTA if _iota(e) else CLEAN] * len(e.outputs)
    if rule is None:
        return [UNKNOWN] * len(e.outputs)
    try:
        return rule(Ctx(e, m, states, own_norms))
    except Mixes:
        raise
    except Exception as exc:  # noqa: BLE001 -- a rule that cannot read these arguments: unknown, never a refusal
        log.debug("batch rows: %s not followed (%s: %s)", e.op, type(exc).__name__, exc)
        return [UNKNOWN] * len(e.outputs)


def _operands(e: Eqn) -> str:
    ins = ", ".join(str(v.aval) for v in e.inputs)
    return f"{ins} -> {', '.join(str(v.aval) for v in e.out_vars)}"


def batch_rows(g: Graph, m: int | None = None, *, own_norms: bool = False) -> tuple[dict[Var, Rows], list[MixedRows]]:
    """Every value's state and every op that mixes rows (in graph order; a mixing op's outputs are then
    unknown). `m`: the rows of a microbatch, by default the batch inputs' dim 0. `own_norms`: train-mode
    BatchNorm is the engine's (a function `engine.functionalize` made), not a mix."""
    m = m if m is not None else row_count(g)
    states: dict[Var, Rows] = {v: CLEAN for v in g.params}
    states.update((v, rows(0) if v.aval.shape and m else UNKNOWN) for v in g.batch)
    found: list[MixedRows] = []
    for i, e in enumerate(g.eqns):
        try:
            out = _step(e, m or 1, states, own_norms)
        except Mixes as mix:
            found.append(MixedRows(i, e.op, str(mix), _operands(e), e.source))
            out = [UNKNOWN] * len(e.outputs)
        states.update((v, s) for v, s in zip(e.outputs, out) if v is not None)
    return states, found


def mixed_rows(g: Graph, m: int | None = None, *, outputs: Sequence[int] = (0,),
               own_norms: bool = False) -> MixedRows | None:
    """The first op on the path of the outputs numbered `outputs` (by default the loss: what the step's
    gradients come from) whose output mixes the batch's rows, or None: splitting the batch then changes
    nothing but the mean's grouping (see the module docstring). An aux leaf's (`outputs=range(1, n)`) is
    only averaged over the parts, as the README says of aux: the engine warns of it, it does not refuse."""
    _, found = batch_rows(g, m, own_norms=own_norms)
    live = _ancestors(g, [g.outputs[k] for k in outputs], set())
    return next((f for f in found if f.index in live), None)
