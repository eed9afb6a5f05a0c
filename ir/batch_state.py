"""What `ir.batch_rows` knows of a value: which dim carries the batch's rows, and the helpers its rules share.

A value's `Rows` is one of four kinds:

    clean     reads no batch row (params, constants, shapes); `iota` marks a value equal to its index along
              `dim` (`arange(n)`, unsqueezed or expanded): as the index of the rows' dim it keeps each row
              where it is (`x[torch.arange(B), last]`, Hugging Face's masks and pooling)
    rows      index i of dim `dim` belongs to batch row (i // inner) % m, and nothing else reads a row: a
              [B, T, C] activation is rows(0), its [B * T, C] view rows(0, inner=T), a [T, B * H, D] layout
              rows(1, inner=H), and `torch.cat([a, b])` of two [B, D] rows(0) values rows(0) again
    summed    a sum (or mean) over rows of per-row terms: a mean-reduced loss, `x.sum(0)`. Averaging each
              microbatch's value is exact for it and for what is linear in it (scaled, added, cast)
    unknown   reads the batch in a way no rule tracks; nothing downstream of it is refused

m is the microbatch's row count (dim 0 of every batch input). A rule that finds an op mixing rows raises
`Mixes` with the reason; the walk (`ir.batch_rows`) records it and goes on with the op's outputs unknown.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from .core import Eqn, Literal, Var
from .purify import bound

__all__ = ["CLEAN", "IOTA", "UNKNOWN", "Ctx", "Mixes", "Rows", "agree", "rows", "short", "summed"]


@attrs.frozen
class Rows:
    """Where a value's elements come from among the batch's rows (see the module docstring)."""

    kind: str                 # "clean", "rows", "summed" or "unknown"
    dim: int = 0              # rows: the dim that carries them; iota: the dim it counts along
    inner: int = 1            # rows: consecutive indices of `dim` that belong to one row
    iota: bool = False        # clean: equal to its index along `dim`
    origin: str = attrs.field(default="", eq=False)  # summed: the op that summed over rows, for messages

    def __str__(self) -> str:
        if self.kind == "rows":
            return f"rows({self.dim}{f', inner={self.inner}' if self.inner != 1 else ''})"
        return "iota" if self.iota else self.kind

    @property
    def clean(self) -> bool:
        return self.kind == "clean"

    @property
    def rows(self) -> bool:
        return self.kind == "rows"

    @property
    def summed(self) -> bool:
        return self.kind == "summed"

    @property
    def unknown(self) -> bool:
        return self.kind == "unknown"


CLEAN = Rows("clean")
IOTA = Rows("clean", iota=True)
UNKNOWN = Rows("unknown")


def rows(dim: int, inner: int = 1) -> Rows:
    return Rows("rows", dim, inner)


def summed(origin: str) -> Rows:
    return Rows("summed", origin=origin)


class Mixes(Exception):
    """Raised by a rule: the op's output mixes the batch's rows; the message says how."""


def short(op: str) -> str:
    """`aten.matmul.default` -> `matmul`."""
    return op.removeprefix("aten.").split(".")[0]


Rule = Callable[["Ctx"], "list[Rows]"]  # a rule: the states of an equation's outputs (or Mixes)


@attrs.frozen(eq=False)
class Ctx:
    """One equation as a rule sees it: its arguments by schema name, their states and shapes, m."""

    eqn: Eqn
    m: int
    states: Mapping[Var, Rows]
    own_norms: bool = False  # train-mode BatchNorm's statistics are the engine's (engine.functionalize's modules)
    args: dict[str, Any] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "args", bound(self.eqn))

    @property
    def op(self) -> str:
        return short(self.eqn.op)

    def arg(self, name: str) -> Any:
        """The argument `name` (schema name, default filled in; KeyError for a name the op has not); a Literal
        is read as its value."""
        x = self.args[name]
        return x.value if isinstance(x, Literal) else x

    def has(self, name: str) -> bool:
        return name in self.args

    def state(self, x: Any) -> Rows:
        """A Var's state; anything else (a number, a constant tensor, None) is clean."""
        return self.states.get(x, UNKNOWN) if isinstance(x, Var) else CLEAN

    @property
    def first(self) -> Any:
        """The first argument (`self` of most ops): a Var, or a constant."""
        return self.eqn.args[0]

    def tensors(self) -> list[Var]:
        """The equation's Var operands, in order."""
        return list(self.eqn.inputs)

    def out_shape(self, k: int = 0) -> tuple[int, ...]:
        v = self.eqn.outputs[k]
        return v.aval.shape if v is not None else ()

    def outputs(self, state: Rows) -> list[Rows]:
        """`state` for every output of the equation."""
        return [state] * len(self.eqn.outputs)

    def checked(self, state: Rows, shape: Sequence[int]) -> Rows:
        """`state`, or unknown where its dim does not hold a whole number of rows' blocks (a rule's slip is
        not a refusal)."""
        if state.rows and not (0 <= state.dim < len(shape) and shape[state.dim] % (self.m * state.inner) == 0):
            return UNKNOWN
        return state


def shape_of(x: Any) -> tuple[int, ...]:
    """A Var's or a constant tensor's shape; () for a number."""
    if isinstance(x, Var):
        return x.aval.shape
    value = x.value if isinstance(x, Literal) else x
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def agree(found: Sequence[tuple[int, int]]) -> Rows:
    """The output state from (dim, inner) pairs where operands put the batch's rows in the output: clean for
    none, rows when they agree, else `Mixes` (two dims: every row paired with every other)."""
    kinds = sorted(set(found))
    if not kinds:
        return CLEAN
    if len(kinds) == 1:
        return rows(*kinds[0])
    dims = sorted({d for d, _ in kinds})
    if len(dims) > 1:
        raise Mixes(f"pairs the batch's rows: its output has them in dims {dims[0]} and {dims[1]}, every row "
                    "against every other")
    raise Mixes(f"lines up different rows of the batch in dim {dims[0]} of its output")


def reshaped(state: Rows, shape_in: Sequence[int], shape_out: Sequence[int], m: int) -> Rows:
    """The state of a row-major reshape of a value: the dim of `shape_out` whose index range holds the rows'
    whole block (flat stride inner x trailing sizes, m of them), or unknown when a reshape splits it. An
    iota stays one where its dim is kept whole and alone."""
    if state.iota:
        found = reshaped(rows(state.dim), shape_in, shape_out, shape_in[state.dim])
        keeps = found.rows and found.inner == 1 and shape_out[found.dim] == shape_in[state.dim]
        return Rows("clean", found.dim, iota=True) if keeps else CLEAN
    if not state.rows:
        return state if not state.clean else CLEAN
    stride_in = state.inner * math.prod(shape_in[state.dim + 1:])
    span = stride_in * m
    stride = 1
    for j in range(len(shape_out) - 1, -1, -1):
        size = shape_out[j]
        if stride <= stride_in and stride_in % stride == 0 and size * stride >= span and (size * stride) % span == 0:
            return rows(j, stride_in // stride)
        stride *= size
    return UNKNOWN
