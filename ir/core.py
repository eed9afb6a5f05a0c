"""Core IR values: abstract values, variables, literals, equations and graphs."""
from __future__ import annotations

from typing import Any, Iterator

import attrs
import torch
from torch.utils import _pytree as pytree

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


@attrs.frozen
class AbstractValue:
    """Shape, dtype and device of a tensor: all the IR knows about a value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"

    @classmethod
    def of(cls, t: torch.Tensor) -> AbstractValue:
        return cls(tuple(int(s) for s in t.shape), t.dtype, str(t.device))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{DTYPE_NAMES.get(self.dtype, str(self.dtype))}[{','.join(map(str, self.shape))}]"


@attrs.frozen(eq=False)
class Var:
    """A value defined once in a graph. Identity is the variable; names are given when printing."""

    aval: AbstractValue


@attrs.frozen
class Literal:
    """A constant operand: a Python scalar or a small constant tensor captured at trace time."""

    value: Any

    def __str__(self) -> str:
        if isinstance(self.value, torch.Tensor):
            return f"const{AbstractValue.of(self.value)}"
        return repr(self.value)


def _is_var(x: Any) -> bool:
    return isinstance(x, Var)


def vars_in(tree: Any) -> tuple[Var, ...]:
    """Variables in a nested structure of args, in order (duplicates kept)."""
    return tuple(x for x in pytree.tree_leaves(tree) if isinstance(x, Var))


@attrs.frozen(eq=False)
class Eqn:
    """One operation: `outputs = op(*args, **kwargs)`; args may nest Vars in lists.

    `multi` says the op returns a tuple (outputs in order, None where the position is not a
    tensor); otherwise it returns outputs[0]. `nested` is for the few ops that return lists inside
    their tuple (`histogramdd`: a tensor and a list of tensors): per element of the tuple, None for
    one value or the length of its list; `outputs` are then the flattened values in order.
    """

    op: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    outputs: tuple[Var | None, ...]
    multi: bool = False
    source: str = attrs.field(default="", eq=False)
    nested: tuple[int | None, ...] = ()
    inputs: tuple[Var, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "inputs", vars_in((self.args, [v for _, v in self.kwargs])))

    def positions(self) -> list[tuple[int, ...]]:
        """Where each of `outputs` sits in what the op returns: `(i,)`, or `(i, j)` inside a nested list."""
        if not self.nested:
            return [(i,) for i in range(len(self.outputs))]
        return [pos for i, n in enumerate(self.nested) for pos in ([(i,)] if n is None else [(i, j) for j in range(n)])]

    def results(self, out: Any) -> list[Any]:
        """The op's return value as one value per output position."""
        if not self.multi:
            return [out]
        picked = []
        for pos in self.positions():
            x = out
            for k in pos:
                x = x[k]
            picked.append(x)
        return picked

    @property
    def out_vars(self) -> tuple[Var, ...]:
        return tuple(v for v in self.outputs if v is not None)

    def replace_inputs(self, mapping: dict[Var, Any]) -> Eqn:
        """The same op with input variables substituted (for passes that rewire values)."""
        sub = lambda x: mapping.get(x, x) if isinstance(x, Var) else x  # noqa: E731
        args = pytree.tree_map(sub, self.args)
        kwargs = tuple((k, pytree.tree_map(sub, v)) for k, v in self.kwargs)
        return attrs.evolve(self, args=args, kwargs=kwargs)


@attrs.frozen(eq=False)
class Graph:
    """A pure program: inputs, equations in order, outputs.

    The first `num_params` inputs are parameters; the rest are batch (or activation) inputs.
    `in_tree`/`out_tree` restore the user's pytrees; `input_names` are key paths ("blocks.0.w").
    """

    inputs: tuple[Var, ...]
    eqns: tuple[Eqn, ...]
    outputs: tuple[Var | Literal, ...]
    input_names: tuple[str, ...] = ()
    num_params: int = 0
    in_tree: pytree.TreeSpec | None = None
    out_tree: pytree.TreeSpec | None = None
    output_names: tuple[str, ...] = ()

    @property
    def params(self) -> tuple[Var, ...]:
        return self.inputs[: self.num_params]

    @property
    def batch(self) -> tuple[Var, ...]:
        return self.inputs[self.num_params:]

    def defined(self) -> Iterator[Var]:
        """Every variable in definition order: inputs, then each equation's outputs."""
        yield from self.inputs
        for e in self.eqns:
            yield from e.out_vars

    def producers(self) -> dict[Var, int]:
        """Equation index that defines each non-input variable."""
        return {v: i for i, e in enumerate(self.eqns) for v in e.out_vars}

    def last_use(self) -> dict[Var, int]:
        """Index of the last equation reading each variable; len(eqns) for graph outputs."""
        last: dict[Var, int] = {}
        for i, e in enumerate(self.eqns):
            for v in e.inputs:
                last[v] = i
        for v in self.outputs:
            if isinstance(v, Var):
                last[v] = len(self.eqns)
        return last

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)
